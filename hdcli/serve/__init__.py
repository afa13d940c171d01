"""hd serve: an OpenAI-compatible server (server.py) that batches requests and stays exact under load."""
