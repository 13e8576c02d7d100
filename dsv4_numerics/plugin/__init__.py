"""The pytest plugin (``hooks``, registered through the ``pytest11`` entry point) and the xdist
guard that every collected item reports (``lost_items``)."""
