"""The draft model: the loaded draft and its cache pool, its drafter, checking/loading/unloading it."""
