"""What the wire formats share: the internal (chat) request, its prompt and engine arguments, context overflow, admission and collection."""
