"""The session core (floor 3 of docs/architecture.md): what every protocol runs on.

session.py (one Session per WebSocket, HTTP request or gRPC call), transport.py and grpc_server.py (the thin
I/O under it), outcomes.py (how a session ends, and the one table of what each transport answers), port.py
(what a protocol may use of the server), hub.py (the runtime: engine, sessions, admission, drain), stream.py
(SpeechStream: one context from text pieces to ordered audio) and events.py (its vocabulary), voices.py,
observers.py. It uses text/, audio/ and fleet/; the protocols above it see it through the session and the port.
"""
