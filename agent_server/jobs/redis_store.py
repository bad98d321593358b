"""The fleet's job store: everything in Redis, so any replica serves, claims and resumes any job.

Keys (P = the server's `--redis-prefix` + "jobs:"):
    P job:<id>            hash: spec (JSON), plan (JSON), segments_total, status, segments_done, audio_samples,
                          started_at_s, finished_at_s, error, claims, worker, entry (its stream entry id)
    P segs:<id>           hash: segment index -> Ogg Opus audio (segment_audio.py), each field written by HSETNX
    P queue               stream of {job: <id>}, consumer group `workers`; one entry per unfinished job
    P active:<key id>     set: the key's unfinished jobs (the running-jobs quota)
    P chars:<key id>:<day>  the key's characters submitted that UTC day (expires after two days)
    P list:<key id>       sorted set of the key's job ids, all score 0: ids sort by time (`model.new_job_id`)
    P cancels             pub/sub channel: the id of each job cancelled (its renderer stops at once, wherever)
    P webhooks            sorted set: the webhook outbox, job id -> when its next attempt is due (unix s); a job
                          with a webhook has `hook` = 1 in its hash, and `hook_attempts` once one was made

Every change that must not be seen half-done is one Lua script (submit with its quotas, claim, renew, store a
segment, finish with its webhook entering the outbox, release, take due webhooks, put one back). The queue: `submit`
XADDs an entry; a worker takes new entries with XREADGROUP (the entry is then pending, owned by that worker) and
renews its claim with XCLAIM of its own entry (idle time back to 0) while it works; XAUTOCLAIM with `visibility_s`
as the minimum idle time hands the entries of a worker that stopped renewing (killed, hung, partitioned) to the next
worker that claims. A worker whose entry was handed on finds out at its next renewal (LOST) and stops; if it still
stores a segment meanwhile, HSETNX keeps the first copy and nothing is counted twice. `finish` XACKs and XDELs the
entry.

TTLs: a segment hash lives `job_ttl_s` after its last write while the job runs (every store pushes it out), the
record has none until the job finishes; then the audio expires `job_ttl_s` later and the record
`RECORD_GRACE_S` after that. The Redis must not evict these keys (`maxmemory-policy noeviction` or a Redis of its
own for jobs: docs/jobs.md); if a stalled job's segments expired anyway, the next claim starts it over.

Scripts touch a few keys that are not in their KEYS (the active-set clean-up reads job records by name): one
Redis, not a Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog
from redis.exceptions import ResponseError

from agent_server.jobs.model import Job, JobSegment, JobStatus, plan_from_json, plan_to_json
from agent_server.jobs.store import (
    DEFAULT_JOB_TTL_S,
    DEFAULT_LIST_LIMIT,
    DEFAULT_VISIBILITY_S,
    MAX_CLAIMS,
    RECORD_GRACE_S,
    SECONDS_PER_DAY,
    Claim,
    Claimed,
    ClaimState,
    DueWebhook,
    IncompleteJob,
    JobStore,
    KeyLimits,
    Refusal,
    SegmentWrite,
    Usage,
    chars_refusal,
    check_list_limit,
    running_refusal,
    utc_day,
)

log = structlog.get_logger("agent_server.jobs.redis_store")

GROUP = "workers"
MS_PER_S = 1000.0
LIST_KEEP_DAYS = 30  # a key's listing forgets ids older than this (their records are long gone)
PROGRESS_FIELDS = ("spec", "status", "segments_done", "audio_samples", "started_at_s", "finished_at_s", "error",
                   "claims")

_S_DONE = str(int(JobStatus.DONE))
_S_FAILED = str(int(JobStatus.FAILED))

# The end of a job, shared by `finish` and by `claim` (a job claimed too often fails there).
# KEYS[1] job, KEYS[2] segs, KEYS[3] active set, KEYS[4] queue, KEYS[5] webhook outbox. Locals: job_id, status,
# error, now, job_ttl_ms, record_ttl_ms. Leaves `finished` = 1 when it finished the job here, 0 when it had finished
# before, -1 gone. A job with a webhook that ends DONE or FAILED enters the outbox, due now.
_FINISH = """
local finished = 0
local st = redis.call('HGET', KEYS[1], 'status')
if not st then
  finished = -1
elseif tonumber(st) < """ + _S_DONE + """ then
  redis.call('HSET', KEYS[1], 'status', status, 'finished_at_s', now)
  if error ~= '' then redis.call('HSET', KEYS[1], 'error', error) end
  redis.call('HDEL', KEYS[1], 'worker')
  redis.call('SREM', KEYS[3], job_id)
  local entry = redis.call('HGET', KEYS[1], 'entry')
  if entry then
    redis.call('XACK', KEYS[4], '""" + GROUP + """', entry)
    redis.call('XDEL', KEYS[4], entry)
  end
  redis.call('PEXPIRE', KEYS[1], record_ttl_ms)
  redis.call('PEXPIRE', KEYS[2], job_ttl_ms)
  if (status == '""" + _S_DONE + """' or status == '""" + _S_FAILED + """')
      and redis.call('HGET', KEYS[1], 'hook') == '1' then
    redis.call('ZADD', KEYS[5], now, job_id)
  end
  finished = 1
end
"""

# KEYS: job, active, chars, list, queue. ARGV: id, max_running, daily_chars, text_chars, chars_ttl_s, spec, plan,
# segments_total, list_cutoff_id, list_ttl_ms, job key prefix, hook (1: a webhook) -> {1, entry} |
# {0, 'running'|'chars', used}
SUBMIT_LUA = """
local max_running = tonumber(ARGV[2])
if max_running > 0 and redis.call('SCARD', KEYS[2]) >= max_running then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    local st = redis.call('HGET', ARGV[11] .. id, 'status')
    if (not st) or tonumber(st) >= """ + _S_DONE + """ then redis.call('SREM', KEYS[2], id) end
  end
  if redis.call('SCARD', KEYS[2]) >= max_running then return {0, 'running', 0} end
end
local daily = tonumber(ARGV[3])
local chars = tonumber(ARGV[4])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if daily > 0 and used + chars > daily then return {0, 'chars', used} end
redis.call('INCRBY', KEYS[3], chars)
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[5]))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'spec', ARGV[6], 'plan', ARGV[7], 'segments_total', ARGV[8], 'status', 0,
           'segments_done', 0, 'audio_samples', 0, 'claims', 0, 'hook', ARGV[12])
local entry = redis.call('XADD', KEYS[5], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'entry', entry)
redis.call('ZADD', KEYS[4], 0, ARGV[1])
redis.call('ZREMRANGEBYLEX', KEYS[4], '-', '(' .. ARGV[9])
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[10]))
return {1, entry, used}
"""

# KEYS: job, segs, active, queue, webhooks. ARGV: id, entry, worker, now, max_claims, job_ttl_ms, record_ttl_ms
# -> 1 claimed, 0 skipped (gone, finished, a stale entry: acked and deleted), 2 failed here (too many claims)
CLAIM_LUA = """
local job_id, status, now = ARGV[1], '""" + str(int(JobStatus.FAILED)) + """', ARGV[4]
local job_ttl_ms, record_ttl_ms = tonumber(ARGV[6]), tonumber(ARGV[7])
local st = redis.call('HGET', KEYS[1], 'status')
if (not st) or tonumber(st) >= """ + _S_DONE + """ or redis.call('HGET', KEYS[1], 'entry') ~= ARGV[2] then
  redis.call('XACK', KEYS[4], '""" + GROUP + """', ARGV[2])
  redis.call('XDEL', KEYS[4], ARGV[2])
  return 0
end
local claims = redis.call('HINCRBY', KEYS[1], 'claims', 1)
if claims > tonumber(ARGV[5]) then
  local error = 'claimed ' .. (claims - 1) .. ' times without finishing'
""" + _FINISH + """
  return 2
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[1], 'segments_done', 0, 'audio_samples', 0)
end
redis.call('HSET', KEYS[1], 'status', """ + str(int(JobStatus.RUNNING)) + """, 'worker', ARGV[3])
redis.call('HSETNX', KEYS[1], 'started_at_s', now)
return 1
"""

# KEYS: job, queue. ARGV: entry, worker -> ClaimState (0 held, 1 lost, 2 finished, 3 gone)
RENEW_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 3 end
if tonumber(st) >= """ + _S_DONE + """ then return 2 end
if redis.call('HGET', KEYS[1], 'entry') ~= ARGV[1] then return 1 end
local pending = redis.call('XPENDING', KEYS[2], '""" + GROUP + """', ARGV[1], ARGV[1], 1)
if #pending == 0 or pending[1][2] ~= ARGV[2] then return 1 end
redis.call('XCLAIM', KEYS[2], '""" + GROUP + """', ARGV[2], 0, ARGV[1], 'JUSTID')
return 0
"""

# KEYS: job, queue. ARGV: id, entry, worker -> 1 released (back in the queue under a new entry), 0 not ours
RELEASE_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if (not st) or tonumber(st) >= """ + _S_DONE + """ or redis.call('HGET', KEYS[1], 'entry') ~= ARGV[2] then
  return 0
end
local pending = redis.call('XPENDING', KEYS[2], '""" + GROUP + """', ARGV[2], ARGV[2], 1)
if #pending == 0 or pending[1][2] ~= ARGV[3] then return 0 end
redis.call('XACK', KEYS[2], '""" + GROUP + """', ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'entry', entry, 'status', """ + str(int(JobStatus.QUEUED)) + """)
redis.call('HDEL', KEYS[1], 'worker')
redis.call('HINCRBY', KEYS[1], 'claims', -1)
return 1
"""

# KEYS: job, segs. ARGV: index, blob, samples, segs_ttl_ms -> SegmentWrite
PUT_SEGMENT_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 3 end
if tonumber(st) >= """ + _S_DONE + """ then return 2 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 1 end
redis.call('HINCRBY', KEYS[1], 'segments_done', 1)
redis.call('HINCRBY', KEYS[1], 'audio_samples', tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
return 0
"""

# KEYS: job, segs, active, queue, webhooks, cancels channel. ARGV: id, status, error, now, job_ttl_ms, record_ttl_ms
# -> 1 finished here, 0 finished before, -1 gone, -2 DONE asked with segments missing
FINISH_LUA = """
local job_id, status, error, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local job_ttl_ms, record_ttl_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
if status == '""" + _S_DONE + """' then
  local total = tonumber(redis.call('HGET', KEYS[1], 'segments_total') or '-1')
  local st = redis.call('HGET', KEYS[1], 'status')
  if st and tonumber(st) < """ + _S_DONE + """ and redis.call('HLEN', KEYS[2]) ~= total then return -2 end
end
""" + _FINISH + """
if finished == 1 and status == '""" + str(int(JobStatus.CANCELLED)) + """' then
  redis.call('PUBLISH', KEYS[6], job_id)
end
return finished
"""

# KEYS: webhooks. ARGV: now, lease_s, n -> the job ids due (soonest first), each now due again only after the lease
TAKE_WEBHOOKS_LUA = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local leased_until = tonumber(ARGV[1]) + tonumber(ARGV[2])
for _, id in ipairs(due) do redis.call('ZADD', KEYS[1], leased_until, id) end
return due
"""

# KEYS: job, webhooks. ARGV: id, attempts, due -> 1 put back, 0 no longer there (done elsewhere, or the record gone)
RETRY_WEBHOOK_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'hook_attempts', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""


# KEYS[1] queue. ARGV: group, idle_ms, this worker -> consumers deleted. A consumer that holds nothing and did
# nothing for idle_ms is a replica gone (each process names its own, and a live one polls every second).
FORGET_CONSUMERS_LUA = """
local deleted = 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info['pending'] == 0 and info['idle'] > tonumber(ARGV[2]) and info['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    deleted = deleted + 1
  end
end
return deleted
"""
FORGET_CONSUMERS_IDLE_S = 86_400.0


class RedisJobStore(JobStore):
    shared = True

    def __init__(self, redis: Any, *, prefix: str, worker_id: str, job_ttl_s: float = DEFAULT_JOB_TTL_S,
                 visibility_s: float = DEFAULT_VISIBILITY_S, max_claims: int = MAX_CLAIMS) -> None:
        """`redis`: a `redis.asyncio.Redis` (bytes responses); `prefix`: the server's --redis-prefix."""
        super().__init__(worker_id=worker_id, job_ttl_s=job_ttl_s, visibility_s=visibility_s, max_claims=max_claims)
        self._redis = redis
        self._p = prefix + "jobs:"
        self._submit = redis.register_script(SUBMIT_LUA)
        self._claim = redis.register_script(CLAIM_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._put_segment = redis.register_script(PUT_SEGMENT_LUA)
        self._finish = redis.register_script(FINISH_LUA)
        self._take_webhooks = redis.register_script(TAKE_WEBHOOKS_LUA)
        self._retry_webhook = redis.register_script(RETRY_WEBHOOK_LUA)
        self._forget_consumers = redis.register_script(FORGET_CONSUMERS_LUA)

    # ---- names ------------------------------------------------------------------------------------

    def _job(self, job_id: str) -> str:
        return f"{self._p}job:{job_id}"

    def _segs(self, job_id: str) -> str:
        return f"{self._p}segs:{job_id}"

    def _active(self, key_id: str) -> str:
        return f"{self._p}active:{key_id}"

    def _chars(self, key_id: str, day: str) -> str:
        return f"{self._p}chars:{key_id}:{day}"

    def _list(self, key_id: str) -> str:
        return f"{self._p}list:{key_id}"

    @property
    def _queue(self) -> str:
        return f"{self._p}queue"

    @property
    def _webhooks(self) -> str:
        return f"{self._p}webhooks"

    @property
    def _cancels(self) -> str:
        return f"{self._p}cancels"

    @property
    def _job_ttl_ms(self) -> int:
        return int(self.job_ttl_s * MS_PER_S)

    @property
    def _record_ttl_ms(self) -> int:
        return int((self.job_ttl_s + RECORD_GRACE_S) * MS_PER_S)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._ensure_group()
        await self.forget_consumers(FORGET_CONSUMERS_IDLE_S)

    async def forget_consumers(self, idle_s: float) -> int:
        """Delete the group's consumers that hold no claim and were idle over `idle_s` (replicas that are gone), so
        the group does not grow by one consumer a restart; atomic, so a consumer that just claimed is kept. The
        number deleted."""
        deleted = int(await self._forget_consumers(keys=[self._queue], args=[GROUP, int(idle_s * MS_PER_S),
                                                                              self.worker_id]))
        if deleted:
            log.info("job_consumers_forgotten", consumers=deleted)
        return deleted

    async def _ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self._queue, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ---- clients ------------------------------------------------------------------------------------

    async def submit(self, job: Job, plan: Sequence[JobSegment], limits: KeyLimits, now_s: float) -> Refusal | None:
        job.segments_total = len(plan)
        keep_ms = LIST_KEEP_DAYS * SECONDS_PER_DAY * MS_PER_S
        cutoff_id = f"job_{int(now_s * MS_PER_S - keep_ms):012x}"
        result = await self._submit(
            keys=[self._job(job.id), self._active(job.key_id), self._chars(job.key_id, utc_day(now_s)),
                  self._list(job.key_id), self._queue],
            args=[job.id, limits.max_running_jobs, limits.daily_chars, job.text_chars, 2 * SECONDS_PER_DAY,
                  job.spec_json(), plan_to_json(plan), len(plan), cutoff_id, int(keep_ms), self._p + "job:",
                  int(job.webhook_url is not None)])
        if int(result[0]) == 1:
            return None
        if _s(result[1]) == "running":
            return running_refusal(limits.max_running_jobs)
        return chars_refusal(int(result[2]), limits.daily_chars, job.text_chars, now_s)

    async def get(self, job_id: str) -> Job | None:
        return _record(await self._redis.hmget(self._job(job_id), PROGRESS_FIELDS))

    async def list_jobs(self, key_id: str, now_s: float, *, limit: int = DEFAULT_LIST_LIMIT,
                        before: str | None = None) -> list[Job]:
        """Up to `limit` records, newest first. The listing outlives its records (an id stays 30 days, a record
        its TTL and grace), so ids whose record is gone or whose results expired are skipped, forgotten, and
        replaced by older ones."""
        listing = self._list(key_id)
        limit = check_list_limit(limit)
        jobs: list[Job] = []
        upper = "+" if before is None else f"({before}"
        while len(jobs) < limit:
            ids = [_s(job_id) for job_id in await self._redis.zrevrangebylex(listing, upper, "-", start=0,
                                                                             num=limit - len(jobs))]
            if not ids:
                break
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hmget(self._job(job_id), PROGRESS_FIELDS)
                rows = await pipe.execute()
            gone: list[str] = []
            for job_id, row in zip(ids, rows, strict=True):
                job = _record(row)
                if job is None or job.expired(now_s, self.job_ttl_s):
                    gone.append(job_id)
                else:
                    jobs.append(job)
            if gone:
                await self._redis.zrem(listing, *gone)
            upper = f"({ids[-1]}"
        return jobs

    async def usage(self, key_id: str, now_s: float) -> Usage:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.scard(self._active(key_id))
            pipe.get(self._chars(key_id, utc_day(now_s)))
            unfinished, chars = await pipe.execute()
        return Usage(int(unfinished), int(chars or 0))

    async def queue_depth(self) -> int:
        """Stream entries no worker has taken yet (an entry is XDELed when its job finishes, and pending while a
        worker holds it: a dead worker's claims count as taken until the visibility timeout hands them on)."""
        length = int(await self._redis.xlen(self._queue))
        try:
            pending = await self._redis.xpending(self._queue, GROUP)
        except ResponseError:  # no group yet: nothing was ever claimed
            return length
        return max(0, length - int(pending["pending"]))

    # ---- workers ------------------------------------------------------------------------------------

    async def claim(self, max_jobs: int, now_s: float) -> Claimed:
        claims: list[Claim] = []
        failed: list[Job] = []
        for entry, job_id in await self._entries(max_jobs):
            before = await self.get(job_id)  # (the script must name the key's active set up front)
            active = self._active(before.key_id if before is not None else "")
            outcome = int(await self._claim(
                keys=[self._job(job_id), self._segs(job_id), active, self._queue, self._webhooks],
                args=[job_id, entry, self.worker_id, repr(now_s), self.max_claims, self._job_ttl_ms,
                      self._record_ttl_ms]))
            job = await self.get(job_id) if outcome else None
            if job is None:
                continue
            if outcome == 1:
                claims.append(Claim(job, self.worker_id, entry))
            else:
                failed.append(job)
        return Claimed(claims, failed)

    async def _entries(self, max_jobs: int) -> list[tuple[str, str]]:
        """(entry id, job id) of abandoned entries (XAUTOCLAIM, following its cursor over the whole pending list),
        then new ones (XREADGROUP)."""
        try:
            entries: list[Any] = []
            cursor = "0-0"
            while len(entries) < max_jobs:  # one pass over the pending list: a call scans at most 10 x count
                cursor, found, *_deleted = await self._redis.xautoclaim(
                    self._queue, GROUP, self.worker_id, min_idle_time=int(self.visibility_s * MS_PER_S),
                    start_id=cursor, count=max_jobs - len(entries))
                entries += found
                if _s(cursor) == "0-0":
                    break
            if len(entries) < max_jobs:
                fresh = await self._redis.xreadgroup(GROUP, self.worker_id, {self._queue: ">"},
                                                     count=max_jobs - len(entries))
                for _stream, items in fresh or ():
                    entries += items
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self._ensure_group()  # the stream was deleted under us: the next claim reads it again
            return []
        out: list[tuple[str, str]] = []
        for entry, fields in entries:
            job_id = fields.get(b"job") if fields else None
            if job_id is None:  # deleted meanwhile
                await self._redis.xack(self._queue, GROUP, entry)
                continue
            out.append((_s(entry), _s(job_id)))
        return out

    async def renew(self, claim: Claim, now_s: float) -> ClaimState:
        state = await self._renew(keys=[self._job(claim.job.id), self._queue], args=[claim.token, claim.worker])
        return ClaimState(int(state))

    async def release(self, claim: Claim) -> None:
        await self._release(keys=[self._job(claim.job.id), self._queue],
                            args=[claim.job.id, claim.token, claim.worker])

    async def plan(self, job_id: str) -> tuple[JobSegment, ...] | None:
        raw = await self._redis.hget(self._job(job_id), "plan")
        return None if raw is None else plan_from_json(raw)

    async def stored_segments(self, job_id: str) -> set[int]:
        return {int(index) for index in await self._redis.hkeys(self._segs(job_id))}

    async def put_segment(self, job_id: str, index: int, blob: bytes, samples: int) -> SegmentWrite:
        outcome = await self._put_segment(keys=[self._job(job_id), self._segs(job_id)],
                                          args=[index, blob, samples, self._job_ttl_ms])
        return SegmentWrite(int(outcome))

    async def segment(self, job_id: str, index: int) -> bytes | None:
        blob = await self._redis.hget(self._segs(job_id), str(index))
        return None if blob is None else bytes(blob)

    async def finish(self, job_id: str, status: JobStatus, error: str | None, now_s: float) -> tuple[Job | None, bool]:
        if not status.finished:
            raise ValueError(f"finish with {status.name}")
        job = await self.get(job_id)
        if job is None:
            return None, False
        outcome = int(await self._finish(
            keys=[self._job(job_id), self._segs(job_id), self._active(job.key_id), self._queue, self._webhooks,
                  self._cancels],
            args=[job_id, int(status), error or "", repr(now_s), self._job_ttl_ms, self._record_ttl_ms]))
        if outcome == -2:
            raise IncompleteJob(f"{job_id}: {len(await self.stored_segments(job_id))} of {job.segments_total} "
                                "segments stored")
        return await self.get(job_id), outcome == 1

    async def watch_cancels(self, cancelled: Callable[[str], None]) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._cancels)
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    cancelled(_s(message["data"]))
        finally:
            await pubsub.aclose()

    # ---- the webhook outbox -------------------------------------------------------------------------

    async def take_webhooks(self, max_n: int, now_s: float, lease_s: float) -> list[DueWebhook]:
        ids = [_s(job_id) for job_id in await self._take_webhooks(keys=[self._webhooks],
                                                                  args=[repr(now_s), repr(lease_s), max_n])]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(self._job(job_id), (*PROGRESS_FIELDS, "hook_attempts"))
            rows = await pipe.execute()
        due: list[DueWebhook] = []
        for job_id, row in zip(ids, rows, strict=True):
            job = _record(row[:-1])
            if job is None:
                await self._redis.zrem(self._webhooks, job_id)
            else:
                due.append(DueWebhook(job, int(row[-1] or 0)))
        return due

    async def webhook_retry(self, job_id: str, attempts: int, due_s: float) -> None:
        await self._retry_webhook(keys=[self._job(job_id), self._webhooks], args=[job_id, attempts, repr(due_s)])

    async def webhook_done(self, job_id: str) -> None:
        await self._redis.zrem(self._webhooks, job_id)

    async def webhooks_pending(self) -> int:
        return int(await self._redis.zcard(self._webhooks))


def _record(row: Sequence[Any]) -> Job | None:
    if row[0] is None:
        return None
    progress = dict(zip(PROGRESS_FIELDS[1:], (_s(v) if v is not None else None for v in row[1:]), strict=True))
    return Job.from_stored(row[0], progress)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
