"""Shared state: what the replicas behind one load balancer must agree on, in Redis or in this process.

One `SharedState` per app (`hub.shared`), built by `shared_state_from(settings)`:
- `LocalState` (no `--redis-url`): everything lives in this process, so `make serve` needs nothing.
- `RedisState` (`--redis-url` / AGENT_SERVER_REDIS_URL): the same operations, atomic in Redis (Lua scripts
  using the server's clock), so they hold across replicas.

What is shared (never KV caches or GPU state):
- leases: one per admitted session of a key with a session limit, a sorted-set member that expires
  `lease_ttl_s` after its replica last refreshed it. A replica refreshes its own every `lease_ttl_s / 3`;
  one that dies (kill -9, a lost node) stops refreshing, and its sessions stop counting within `lease_ttl_s`.
- token buckets: the per-key text budget (taken atomically; the bucket expires once it would be full).
- API keys added at run time (by their SHA-256, never the key), revoked keys, revoked tokens, and the
  index of uploaded voices (with their clip and computed conditioning, fetched on demand).
  These are small and read on every handshake, so each replica keeps a mirror (`Mirror`) that it reloads
  whenever the shared generation counter moved (polled every `SYNC_PERIOD_S`): the checks stay
  synchronous, and keep working from the last copy while Redis is down (a revocation cannot be made then).

Redis down: every operation that needs it raises `SharedStateUnavailable` at once (no wait after the first
failure), `available` turns False with a `detail`, and the sync loop keeps probing; when Redis answers
again the replica re-registers its live sessions' leases and reloads the mirror. What the server refuses
meanwhile is decided by the callers (auth.py, voices.py) and listed in docs/operations.md.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from redis.exceptions import RedisError

log = structlog.get_logger("agent_server.shared_state")

SYNC_PERIOD_S = 0.25  # how often a replica polls the shared generation (and probes a Redis that was down)
REDIS_TIMEOUT_S = 0.5  # connect and per-command socket timeout: a hung Redis must not hang a handshake
DEFAULT_PREFIX = "agent-server:"
MS_PER_S = 1000.0

# Lua: every script reads the Redis server's clock, so replicas with skewed clocks still agree.
_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS[1] lease set; ARGV: limit (0: none), holder, ttl_ms -> 1 taken (or already held), 0 at the limit
ACQUIRE_LUA = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local limit = tonumber(ARGV[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) and limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""
# KEYS[1] lease set; ARGV: ttl_ms, holder... -> every holder's lease runs ttl_ms from now (re-added if lost)
REFRESH_LUA = _NOW_MS + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return #ARGV - 1
"""
# KEYS[1] lease set -> live leases
COUNT_LUA = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
# KEYS[1] bucket hash; ARGV: amount, capacity, refill per ms -> 1 taken, 0 refused (nothing taken)
TAKE_LUA = _NOW_MS + """
local amount = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local rate = tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(state[1])
local at = tonumber(state[2])
if level == nil or at == nil then level = capacity; at = now end
level = math.min(capacity, level + math.max(0, now - at) * rate)
local taken = 0
if amount <= level then level = level - amount; taken = 1 end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate) + 1000)
return taken
"""
# KEYS: voice index, voice hash, generation; ARGV: voice id, record, clip, then (field, conditioning) pairs
# -> 1 created, 0 exists
CREATE_VOICE_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'record', ARGV[2], 'clip', ARGV[3], unpack(ARGV, 4))
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[3])
return 1
"""
# KEYS: voice index, voice hash; ARGV: voice id, version, field, conditioning -> 1 added, 0 the voice changed or went
ADD_CONDITIONING_LUA = """
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record or cjson.decode(record)['version'] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1
"""
CONDITIONING_FIELD = "conditioning:"  # + the weights identity of the model that computed it
LEGACY_CONDITIONING_FIELD = "conditioning"  # one model's, the record's weights_id (replicas from before)


class SharedStateUnavailable(Exception):
    """The shared state cannot be reached now: refuse what needs it, serve the rest."""


@dataclass(frozen=True, slots=True)
class VoiceRecord:
    """An uploaded voice as every replica sees it. `version` is a content hash of its conditioning: a
    changed voice has another version, and the phrase cache keys by it."""

    voice_id: str
    version: str
    name: str
    created_at: str
    duration_s: float
    sample_rate_hz: int
    weights_id: str  # the creating replica's default model's weights (`version` hashes that model's conditioning)
    description: str = ""
    language: str = ""

    def to_json(self) -> bytes:
        return orjson.dumps({f: getattr(self, f) for f in self.__slots__})

    @classmethod
    def from_json(cls, raw: bytes | str) -> VoiceRecord:
        obj = orjson.loads(raw)
        return cls(str(obj["voice_id"]), str(obj["version"]), str(obj.get("name", "")), str(obj.get("created_at", "")),
                   float(obj.get("duration_s", 0.0)), int(obj.get("sample_rate_hz", 0)), str(obj.get("weights_id", "")),
                   str(obj.get("description", "")), str(obj.get("language", "")))


@dataclass(frozen=True, slots=True)
class VoiceData:
    record: VoiceRecord
    clip_wav: bytes  # the reference clip as uploaded (16-bit PCM WAV)
    # EngineLike.export_voice of it for each model computed so far, by that model's weights identity
    conditioning: Mapping[str, bytes]


@dataclass(slots=True)
class Mirror:
    """This replica's copy of the small shared sets (read synchronously on every handshake)."""

    key_hashes: dict[str, str] = field(default_factory=dict)  # SHA-256 hex of a key added at run time -> fingerprint
    revoked_keys: set[str] = field(default_factory=set)  # fingerprints
    revoked_tokens: dict[str, float] = field(default_factory=dict)  # token id -> its expiry (unix s)
    voices: dict[str, VoiceRecord] = field(default_factory=dict)
    generation: int = -1  # the shared generation it was loaded at
    loaded_monotonic_s: float = 0.0


@dataclass(slots=True)
class _Bucket:
    level: float
    at_s: float


class SharedState:
    """The interface (and the part both backends share: the mirror, the leases this replica holds)."""

    shared = False  # True when other replicas see the same state

    def __init__(self, *, lease_ttl_s: float = 10.0, replica_id: str | None = None,
                 sync_period_s: float = SYNC_PERIOD_S) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.sync_period_s = sync_period_s
        self.replica_id = replica_id or f"{socket.gethostname()}-{secrets.token_hex(3)}"
        self.mirror = Mirror()
        self.available = True
        self.detail = "in-process"
        self._held: dict[str, set[str]] = {}  # scope -> holders this replica has leased there

    async def start(self) -> None:
        """Connect and load the mirror (the server is not ready before this returns)."""

    async def stop(self) -> None:
        """Release this replica's leases (best effort) and disconnect."""

    def status_json(self) -> dict[str, object]:
        return {
            "backend": "redis" if self.shared else "local",
            "available": self.available,
            "detail": self.detail,
            "replica_id": self.replica_id,
            "lease_ttl_s": self.lease_ttl_s,
            "leases_held": sum(len(h) for h in self._held.values()),
            "voices": len(self.mirror.voices),
        }

    # ---- synchronous checks, from the mirror -------------------------------------------------------

    def key_of_hash(self, key_hash: str) -> str | None:
        """The fingerprint of a key added at run time, by the key's SHA-256 (None: not one of them)."""
        return self.mirror.key_hashes.get(key_hash)

    def key_revoked(self, key_id: str) -> bool:
        return key_id in self.mirror.revoked_keys

    def token_revoked(self, token_id: str) -> bool:
        return token_id in self.mirror.revoked_tokens

    def voice_index(self) -> dict[str, VoiceRecord]:
        return self.mirror.voices

    # ---- leases (per-key concurrent sessions) ------------------------------------------------------

    async def acquire_lease(self, scope: str, holder: str, limit: int) -> bool:
        """Take a lease in `scope` unless `limit` (> 0) are live. Raises SharedStateUnavailable."""
        raise NotImplementedError

    async def release_lease(self, scope: str, holder: str) -> None:
        """Give a lease back. Never raises: a lease that cannot be removed now expires on its own."""
        raise NotImplementedError

    async def lease_count(self, scope: str) -> int:
        raise NotImplementedError

    # ---- token buckets (per-key text rate) ---------------------------------------------------------

    async def take(self, scope: str, amount: float, capacity: float, refill_per_s: float) -> bool:
        """Take `amount` from the bucket (full at first, refilled continuously up to `capacity`), or
        nothing when it holds less. Raises SharedStateUnavailable."""
        raise NotImplementedError

    # ---- keys and revocations ----------------------------------------------------------------------

    async def add_key(self, key_hash: str, key_id: str) -> None:
        raise NotImplementedError

    async def revoke_key(self, key_id: str) -> None:
        raise NotImplementedError

    async def revoke_token(self, token_id: str, expires_at_s: float) -> None:
        raise NotImplementedError

    # ---- voices (only a shared backend keeps them; LocalState leaves them to the disk store) ---------

    async def put_voice(self, data: VoiceData) -> bool:
        """Create a voice (False: its id exists already). Raises SharedStateUnavailable."""
        raise NotImplementedError

    async def get_voice(self, voice_id: str) -> VoiceData | None:
        raise NotImplementedError

    async def add_conditioning(self, voice_id: str, version: str, weights_id: str, conditioning: bytes) -> bool:
        """Add one model's conditioning to a shared voice, if it is still the voice of that `version` (False:
        it changed or went). Raises SharedStateUnavailable."""
        raise NotImplementedError

    async def delete_voice(self, voice_id: str) -> None:
        raise NotImplementedError

    async def refresh(self) -> None:
        """Reload the mirror now (after this replica changed something, or to read its own writes)."""

    # ---- helpers -----------------------------------------------------------------------------------

    def _hold(self, scope: str, holder: str) -> None:
        self._held.setdefault(scope, set()).add(holder)

    def _unhold(self, scope: str, holder: str) -> None:
        holders = self._held.get(scope)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._held[scope]


class LocalState(SharedState):
    """Everything in this process (one replica): exact, never unavailable."""

    def __init__(self, *, lease_ttl_s: float = 10.0, replica_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(lease_ttl_s=lease_ttl_s, replica_id=replica_id)
        self._buckets: dict[str, _Bucket] = {}
        self._clock = clock  # the buckets' clock (tests turn it by hand)

    async def acquire_lease(self, scope: str, holder: str, limit: int) -> bool:
        holders = self._held.get(scope, set())
        if holder not in holders and limit > 0 and len(holders) >= limit:
            return False
        self._hold(scope, holder)
        return True

    async def release_lease(self, scope: str, holder: str) -> None:
        self._unhold(scope, holder)

    async def lease_count(self, scope: str) -> int:
        return len(self._held.get(scope, ()))

    async def take(self, scope: str, amount: float, capacity: float, refill_per_s: float) -> bool:
        now_s = self._clock()
        bucket = self._buckets.get(scope)
        if bucket is None:
            bucket = self._buckets[scope] = _Bucket(capacity, now_s)
        bucket.level = min(capacity, bucket.level + max(0.0, now_s - bucket.at_s) * refill_per_s)
        bucket.at_s = now_s
        if amount > bucket.level:
            return False
        bucket.level -= amount
        return True

    async def add_key(self, key_hash: str, key_id: str) -> None:
        self.mirror.key_hashes[key_hash] = key_id
        self.mirror.revoked_keys.discard(key_id)

    async def revoke_key(self, key_id: str) -> None:
        self.mirror.revoked_keys.add(key_id)

    async def revoke_token(self, token_id: str, expires_at_s: float) -> None:
        now_s = time.time()
        revoked = self.mirror.revoked_tokens
        for stale in [t for t, exp in revoked.items() if exp <= now_s]:
            del revoked[stale]
        revoked[token_id] = expires_at_s

    async def put_voice(self, data: VoiceData) -> bool:
        raise SharedStateUnavailable("voices are kept on disk without a shared state")

    async def get_voice(self, voice_id: str) -> VoiceData | None:
        return None

    async def add_conditioning(self, voice_id: str, version: str, weights_id: str, conditioning: bytes) -> bool:
        return False

    async def delete_voice(self, voice_id: str) -> None:
        return None


class RedisState(SharedState):
    shared = True

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, lease_ttl_s: float = 10.0,
                 replica_id: str | None = None, sync_period_s: float = SYNC_PERIOD_S) -> None:
        super().__init__(lease_ttl_s=lease_ttl_s, replica_id=replica_id, sync_period_s=sync_period_s)
        import redis.asyncio as aioredis  # only a replica with --redis-url needs the package

        self.url = url
        self.prefix = prefix
        self.available = False
        self.detail = "connecting"
        self.failures = 0  # times Redis became unreachable
        self._redis: Any = aioredis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S, retry_on_timeout=False,
            health_check_interval=0,
        )
        self._acquire = self._redis.register_script(ACQUIRE_LUA)
        self._refresh_leases = self._redis.register_script(REFRESH_LUA)
        self._count = self._redis.register_script(COUNT_LUA)
        self._take = self._redis.register_script(TAKE_LUA)
        self._create_voice = self._redis.register_script(CREATE_VOICE_LUA)
        self._add_conditioning = self._redis.register_script(ADD_CONDITIONING_LUA)
        self._task: asyncio.Task[None] | None = None
        self._next_refresh_s = 0.0

    # ---- names ------------------------------------------------------------------------------------

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    @property
    def _gen(self) -> str:
        return self._k("gen")

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._call(self._load_mirror())
        except SharedStateUnavailable:
            log.warning("shared_state_unavailable_at_start", url=_redact(self.url), detail=self.detail)
        self._task = asyncio.create_task(self._sync_loop(), name="shared-state-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.available:
            for scope, holders in list(self._held.items()):
                try:
                    await self._redis.zrem(self._k("lease", scope), *holders)
                except (RedisError, OSError):  # best effort: they expire anyway
                    break
        self._held.clear()
        await self._redis.aclose()

    def status_json(self) -> dict[str, object]:
        return {**super().status_json(), "url": _redact(self.url), "prefix": self.prefix,
                "unavailable_episodes": self.failures}

    # ---- operations ---------------------------------------------------------------------------------

    async def acquire_lease(self, scope: str, holder: str, limit: int) -> bool:
        ok = await self._call(self._acquire(keys=[self._k("lease", scope)], args=[limit, holder, self._ttl_ms]))
        if ok:
            self._hold(scope, holder)
        return bool(ok)

    async def release_lease(self, scope: str, holder: str) -> None:
        self._unhold(scope, holder)
        if not self.available:
            return  # it expires within lease_ttl_s
        try:
            await self._call(self._redis.zrem(self._k("lease", scope), holder))
        except SharedStateUnavailable:
            pass

    async def lease_count(self, scope: str) -> int:
        return int(await self._call(self._count(keys=[self._k("lease", scope)])))

    async def take(self, scope: str, amount: float, capacity: float, refill_per_s: float) -> bool:
        taken = await self._call(self._take(keys=[self._k("bucket", scope)],
                                            args=[amount, capacity, refill_per_s / MS_PER_S]))
        return bool(taken)

    async def add_key(self, key_hash: str, key_id: str) -> None:
        await self._change(lambda p: (p.hset(self._k("keys"), key_hash, key_id),
                                      p.srem(self._k("revoked-keys"), key_id)))

    async def revoke_key(self, key_id: str) -> None:
        await self._change(lambda p: (p.sadd(self._k("revoked-keys"), key_id),))

    async def revoke_token(self, token_id: str, expires_at_s: float) -> None:
        key = self._k("revoked-tokens")
        await self._change(lambda p: (p.zremrangebyscore(key, "-inf", time.time()),
                                      p.zadd(key, {token_id: expires_at_s})))

    async def put_voice(self, data: VoiceData) -> bool:
        record = data.record
        fields: list[str | bytes] = []
        for weights_id, conditioning in data.conditioning.items():
            fields += [CONDITIONING_FIELD + weights_id, conditioning]
        if record.weights_id in data.conditioning:  # what a replica from before reads
            fields += [LEGACY_CONDITIONING_FIELD, data.conditioning[record.weights_id]]
        created = await self._call(self._create_voice(
            keys=[self._k("voices"), self._k("voice", record.voice_id), self._gen],
            args=[record.voice_id, record.to_json(), data.clip_wav, *fields]))
        await self._call(self._load_mirror())
        return bool(created)

    async def get_voice(self, voice_id: str) -> VoiceData | None:
        raw = await self._call(self._redis.hgetall(self._k("voice", voice_id)))
        fields = {bytes(name).decode(): bytes(value) for name, value in raw.items()}
        if "record" not in fields or "clip" not in fields:
            return None
        record = VoiceRecord.from_json(fields["record"])
        conditioning = {name.removeprefix(CONDITIONING_FIELD): value for name, value in fields.items()
                        if name.startswith(CONDITIONING_FIELD)}
        if LEGACY_CONDITIONING_FIELD in fields:
            conditioning.setdefault(record.weights_id, fields[LEGACY_CONDITIONING_FIELD])
        return VoiceData(record, fields["clip"], conditioning)

    async def add_conditioning(self, voice_id: str, version: str, weights_id: str, conditioning: bytes) -> bool:
        added = await self._call(self._add_conditioning(
            keys=[self._k("voices"), self._k("voice", voice_id)],
            args=[voice_id, version, CONDITIONING_FIELD + weights_id, conditioning]))
        return bool(added)

    async def delete_voice(self, voice_id: str) -> None:
        await self._change(lambda p: (p.hdel(self._k("voices"), voice_id), p.delete(self._k("voice", voice_id))))

    async def refresh(self) -> None:
        await self._call(self._load_mirror())

    # ---- internals ----------------------------------------------------------------------------------

    @property
    def _ttl_ms(self) -> int:
        return int(self.lease_ttl_s * MS_PER_S)

    async def _call(self, awaitable: Any) -> Any:
        """Await one Redis operation; any failure marks the state unavailable and raises SharedStateUnavailable.
        While unavailable, fail at once (the sync loop probes)."""
        if not self.available and self.detail != "connecting":
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()  # never awaited: do not leave a coroutine behind
            raise SharedStateUnavailable(self.detail)
        try:
            return await awaitable
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc)
            raise SharedStateUnavailable(self.detail) from exc

    async def _change(self, build: Any) -> None:
        """Apply a change in one MULTI/EXEC with a bump of the shared generation, then reload the mirror."""

        async def run() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                build(pipe)
                pipe.incr(self._gen)
                await pipe.execute()

        await self._call(run())
        await self._call(self._load_mirror())

    def _mark_down(self, exc: BaseException) -> None:
        if self.available or self.detail == "connecting":
            self.failures += 1
            log.error("shared_state_down", url=_redact(self.url), error=f"{type(exc).__name__}: {exc}"[:300])
        self.available = False
        self.detail = f"redis unreachable: {type(exc).__name__}: {exc}"[:300]

    async def _load_mirror(self) -> None:
        now_s = time.time()
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.get(self._gen)
            pipe.hgetall(self._k("keys"))
            pipe.smembers(self._k("revoked-keys"))
            pipe.zrangebyscore(self._k("revoked-tokens"), now_s, "+inf", withscores=True)
            pipe.hgetall(self._k("voices"))
            gen, keys, revoked_keys, revoked_tokens, voices = await pipe.execute()
        mirror = Mirror(
            key_hashes={_s(h): _s(k) for h, k in keys.items()},
            revoked_keys={_s(k) for k in revoked_keys},
            revoked_tokens={_s(t): float(exp) for t, exp in revoked_tokens},
            voices={},
            generation=int(gen or 0),
            loaded_monotonic_s=time.monotonic(),
        )
        for voice_id, raw in voices.items():
            try:
                mirror.voices[_s(voice_id)] = VoiceRecord.from_json(raw)
            except (ValueError, KeyError, TypeError):
                log.error("shared_voice_record_unreadable", voice_id=_s(voice_id))
        self.mirror = mirror
        if not self.available:
            log.info("shared_state_up", url=_redact(self.url), voices=len(mirror.voices))
        self.available = True
        self.detail = "connected"

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_period_s)
            try:
                await self._sync_once()
            except Exception as exc:
                self._mark_down(exc)

    async def _sync_once(self) -> None:
        was_available = self.available
        gen = await self._redis.get(self._gen)  # a probe too, while unavailable
        now_s = time.monotonic()
        if not was_available or int(gen or 0) != self.mirror.generation:
            await self._load_mirror()
        if not was_available or now_s >= self._next_refresh_s:
            self._next_refresh_s = now_s + self.lease_ttl_s / 3.0
            await self._refresh_held()

    async def _refresh_held(self) -> None:
        """Push every lease this replica holds another lease_ttl_s out (and re-add any lost with Redis)."""
        if not self._held:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for scope, holders in self._held.items():
                await self._refresh_leases(keys=[self._k("lease", scope)], args=[self._ttl_ms, *sorted(holders)],
                                           client=pipe)
            await pipe.execute()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _redact(url: str) -> str:
    """The URL without its password (redis://:secret@host -> redis://:***@host)."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"


def shared_state_from(settings: Any) -> SharedState:
    """RedisState when settings.redis_url is set, else LocalState."""
    if settings.redis_url:
        return RedisState(settings.redis_url, prefix=settings.redis_prefix, lease_ttl_s=settings.shared_lease_ttl_s)
    return LocalState(lease_ttl_s=settings.shared_lease_ttl_s)
