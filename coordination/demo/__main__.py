"""`python -m coordination.demo`: the main job, as `ray-ckpt demo` runs it."""

import sys

from coordination.demo.run import demo_command_main

sys.exit(demo_command_main(sys.argv[1:]))
