"""The models the server hosts: entries and their states, loading and unloading, admission and the running generations, drafts."""
