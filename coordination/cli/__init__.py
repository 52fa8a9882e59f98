"""The `ray-ckpt` command line (the library's commands; `coordination.demo.app`
adds the main job's `demo` on top)."""
