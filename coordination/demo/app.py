"""The `ray-ckpt` command: the library's command line with the main job on top.

`coordination.cli.commands` is the library's command line and knows nothing of the
demo; the demo is the application above every library, so the console
script is this module's `main`, which adds the `demo` command to the group.
"""

from __future__ import annotations

import sys

import click

from coordination.cli.commands import main as cli_main
from coordination.demo.run import demo_command_main


# No help option of its own: `--help` goes on to the demo, which prints its options.
@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": [],
    }
)
@click.pass_context
def demo(ctx: click.Context) -> None:
    """Run the end-to-end demo (`ray-ckpt demo --help` lists its options)."""
    sys.exit(demo_command_main(list(ctx.args)))


cli_main.add_command(demo)
main = cli_main
