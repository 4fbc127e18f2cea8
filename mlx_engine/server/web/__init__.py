"""HTTP concerns: error objects, the body limit, the Host check, the connection cap, metrics, the chat page."""
