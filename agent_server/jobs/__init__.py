"""Jobs: long texts rendered in the background (`POST /v1/jobs` answers 202 and an id), resumable on any replica.

The parts, one concept per module:
- `model`: the record (`Job`, `JobStatus`, `JobSegment`), its status JSON, `JobError` (the native HTTP error shape);
- `request`: `POST /v1/jobs` bodies (the native `open` parser checks voice, seed, sampling, language);
- `segments`: text -> segment plan (the live segmenter and normaliser; what bounds one segment's time in a row);
- `store` (interface), `sqlite_store` (embedded, `--data-dir`), `redis_store` (a stream + consumer group):
  records, quotas, claims, each segment stored once;
- `segment_audio`: a segment's audio stored as Ogg Opus, decoded identically everywhere;
- `assembly` + `byte_range`: the requested format made from the stored segments (growing stream, whole file, Range);
- `webhooks`: signed deliveries to allowed addresses only, with retries;
- `runner`: claims, renders the missing segments through a `render` collaborator, finishes, notifies;
- `api`: the HTTP routes, on collaborators the app passes in.

The engine side (job segments only in rows no live segment wants), the app's wiring (auth, settings, metrics,
dashboard) and docs/jobs.md come in the second phase: /work/notes/jobs-plan.md.
"""
