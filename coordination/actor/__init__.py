"""The `Coordinator` Ray actor and only what Ray needs: its options and
name, its memory in the GCS, discovery by name, Ray metrics, and the
periodic loop and drain watch it runs."""
