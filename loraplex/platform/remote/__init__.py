"""Engines in their own processes (`loraplex engine`), reached by API processes over HTTP.

Each engine process registers itself in Redis with a heartbeat, its load and the adapters it holds; API
processes started with `--no-engine` route each request to an engine that already holds its adapter when
one is healthy and not overloaded, else to the least loaded one.
"""
