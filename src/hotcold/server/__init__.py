"""`hotcold serve`: the FastAPI app (app.py), wire formats (protocol.py), request scheduling (scheduler.py),
the guard in front of every route (guard.py), /metrics counters (metrics.py) and the chat page (static/)."""
