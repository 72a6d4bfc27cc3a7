"""Thin FastAPI routers, one file per resource."""
