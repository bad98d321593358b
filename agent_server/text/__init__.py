"""Text before the engine (floor 2 of docs/architecture.md): segmenter.py (an LLM's token stream into speakable
segments), markup.py (vendors' inline tags and SSML: breaks as pauses), normalize/ (numbers, money, times,
dates said as words, per language) and timestamps.py (character and word times in each vendor's units). Pure:
no I/O; it knows neither audio/ nor fleet/."""
