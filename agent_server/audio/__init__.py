"""Audio after the engine (floor 2 of docs/architecture.md): formats.py (PCM16 and G.711 at any rate, resampling,
framing), codecs.py (every output format a client can ask for: MP3, Opus, AAC, FLAC, WAV, tempo) and
encode_lane.py (compressed formats encoded off the event loop, in order). It knows neither text/ nor fleet/."""
