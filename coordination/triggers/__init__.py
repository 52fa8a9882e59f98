"""What starts a checkpoint nobody asked for by hand: the periodic loop,
signals, a node drain."""
