"""Stand-in package marker (the real package imports the engine)."""
