"""Who may use the server: API keys, short-lived signed tokens, an origin allowlist, per-key limits.

One check for every endpoint (`AuthMiddleware`, outermost ASGI layer): an HTTP request or a WebSocket
handshake without valid credentials is answered 401 (403 for a forbidden browser origin, or a token
used where only a key will do) before any route runs, so a refused WebSocket is never upgraded.

- keys: `Settings.api_keys` (env AGENT_SERVER_API_KEYS, comma list) and `Settings.api_keys_file` (one
  key per line, `#` comments), plus keys added at run time to the shared state (`python -m
  agent_server.fleet.keys`). Only their SHA-256 is kept in memory (and in Redis). A key is never logged: logs,
  metrics and /v1/status name it by its fingerprint (`k_` + 12 hex digits of its SHA-256). A key revoked in
  the shared state is refused by every replica (with its tokens).
- where a credential is read, first found wins: `Authorization: Bearer K` (or `Token K`, Deepgram's
  form), `X-API-Key`, `xi-api-key` (ElevenLabs) headers; `token`, `access_token`, `api_key`,
  `xi_api_key` query parameters (browsers cannot set WebSocket headers).
- tokens: `POST /v1/tokens` with a key answers `{"token", "expires_at", "expires_in_s", "token_id"}`; the
  token (`v1.<payload>.<HMAC-SHA256>`) stands for that key until it expires (or is revoked with `POST
  /v1/tokens/revoke`) and is what a browser puts in the WebSocket URL (`?token=...`). The secret is
  `Settings.token_secret` (AGENT_SERVER_TOKEN_SECRET; set it when several server processes must accept
  each other's tokens) or a random one per process.
- mode: `on`, `off` or `auto`: on when keys are configured or a keys file is named (an empty file refuses
  to start rather than leave the port open), and from the moment a key is added to the shared state (`python
  -m agent_server.fleet.keys add`; revoking every key later does not turn it off), else off. Off is logged loudly
  (`auth_off`, level warning) and shown in /v1/status (`auth.enabled: false` and a warning). A replica that
  starts while its shared state (Redis) is unreachable cannot know whether the fleet has keys: it fails
  closed (`auth_pending`): a configured key is served, anything else is a 503 `auth_unavailable` (a key the
  shared state holds cannot be checked yet, so not a 401) until the shared state is first read.
- per-key limits: concurrent sessions (checked by `Hub.admit`, so a refusal is the protocol's own
  `busy` + close 1013, or 429 over HTTP) and text characters per minute (a token bucket charged by the
  sessions through `Auth.charge_text`). Both live in the shared state (shared_state.py), so they hold
  across replicas; while it is unavailable, what they guard is refused and everything else is served.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

import orjson
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agent_server.fleet.shared_state import LocalState, SharedState, SharedStateUnavailable
from agent_server.settings import AUTH_MODES, Settings

log = structlog.get_logger("agent_server.auth")
Refusal = Callable[[Scope, int, str, str], Response | None]  # (scope, status, code, message) -> a response, or None

PRINCIPAL_KEY = "agent_server.principal"  # scope key: the Principal of an authenticated request
TOKEN_PREFIX = "v1"
TOKEN_SECRET_BYTES = 32
MAX_TOKEN_CHARS = 512
MAX_KEY_CHARS = 256
FINGERPRINT_HEX = 12
ANONYMOUS = "anonymous"  # the principal when auth is off
AUTH_OFF_WARNING = (
    "AUTHENTICATION IS OFF: anyone who can reach this port can use it. Configure API keys "
    "(AGENT_SERVER_API_KEYS or --api-keys-file) to turn it on."
)
AUTH_UNAVAILABLE = "auth_unavailable"
SHARED_KEYS_UNKNOWN = "the shared key store (Redis) has not been reachable since this server started"
# Paths open to everyone: probes, and the static pages (they hold no data; their WebSocket is checked).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/", "/dashboard"})
PUBLIC_PREFIXES = ("/static/",)
# Open unless Settings.metrics_auth: a Prometheus scraper usually has no key.
METRICS_PATHS = frozenset({"/metrics", "/dashboard/stream"})
HEADER_NAMES = (b"authorization", b"x-api-key", b"xi-api-key")
QUERY_NAMES = ("token", "access_token", "api_key", "xi_api_key")
AUTHORIZATION_SCHEMES = ("bearer", "token")  # a bare `Authorization: <key>` is refused (401 invalid_authorization)
TOKEN_PATH = "/v1/tokens"
REVOKE_PATH = "/v1/tokens/revoke"
SECONDS_PER_MINUTE = 60.0
TOKEN_ID_BYTES = 9
SESSIONS_SCOPE = "sessions:"  # + key fingerprint: the shared lease set of a key's sessions
TEXT_SCOPE = "text:"  # + key fingerprint: the shared token bucket of a key's text
UNCHECKABLE = "cannot be checked now (the shared state is unavailable); try again shortly"


class AuthConfigError(ValueError):
    """The auth settings cannot work (e.g. `auth=on` and no keys)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: the key's fingerprint (never the key itself)."""

    key_id: str
    via_token: bool = False


class Denied(Exception):
    def __init__(self, status_code: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message


def key_hash(key: str) -> str:
    """What is kept of a key: its SHA-256 (hex)."""
    return hashlib.sha256(key.encode()).hexdigest()


def fingerprint(key: str) -> str:
    return "k_" + key_hash(key)[:FINGERPRINT_HEX]


def check_key_format(key: str) -> str:
    """The key stripped; raises AuthConfigError when it cannot be a key."""
    key = key.strip()
    if not key or len(key) > MAX_KEY_CHARS or any(c.isspace() for c in key):
        raise AuthConfigError(f"an API key must be 1-{MAX_KEY_CHARS} characters without spaces")
    return key


def read_keys_file(path: Path) -> list[str]:
    """One key per line; blank lines and `#` comments (a line's own, or after a key and a space) are skipped.
    A line that cannot be a key is refused naming the file and the line."""
    keys = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split(" #", 1)[0].split("\t#", 1)[0].strip()
        if line and not line.startswith("#"):
            try:
                keys.append(check_key_format(line))
            except AuthConfigError as exc:
                raise AuthConfigError(f"{path}, line {number}: {exc}") from None
    return keys


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Auth:
    """The server's access policy; one per app (`hub.auth`). Every method is called on the event loop."""

    def __init__(
        self,
        *,
        mode: str = "auto",
        keys: Iterable[str] = (),
        token_secret: bytes | None = None,
        token_ttl_s: float = 300.0,
        allowed_origins: Iterable[str] = (),
        metrics_auth: bool = False,
        max_sessions_per_key: int = 0,
        max_text_chars_per_minute_per_key: int = 0,
        shared: SharedState | None = None,
        keys_file: str | None = None,
    ) -> None:
        if mode not in AUTH_MODES:
            raise AuthConfigError(f"auth must be one of {', '.join(AUTH_MODES)} (got {mode!r})")
        self.shared = shared if shared is not None else LocalState()
        self._key_hashes: dict[str, str] = {}  # SHA-256 hex of a configured key -> its fingerprint
        for key in keys:
            if key.strip():
                key = check_key_format(key)
                self._key_hashes[key_hash(key)] = fingerprint(key)
        if mode == "on" and not self._key_hashes and not self.shared.shared:
            raise AuthConfigError("auth is on but no API keys are configured "
                                  "(AGENT_SERVER_API_KEYS or --api-keys-file)")
        if mode != "off" and keys_file is not None and not self._key_hashes and not self.shared.shared:
            raise AuthConfigError(f"the API keys file {keys_file} holds no key: the server would be open to "
                                  "anyone (add keys, or --auth off to run without them)")
        self.mode = mode
        # auto: on once any key is known (configured, a keys file named, or added to the shared state at run
        # time with `python -m agent_server.fleet.keys`), and never back off (revoking every key must not open it)
        self._auto_on = mode == "auto" and (bool(self._key_hashes) or keys_file is not None)
        self._pending_announced = False  # `auth_pending` was logged: `auth_off` is logged when it ends so
        self._secret = token_secret or secrets.token_bytes(TOKEN_SECRET_BYTES)
        self.token_ttl_s = token_ttl_s
        self.allowed_origins = frozenset(o.strip().rstrip("/") for o in allowed_origins if o.strip())
        self.metrics_auth = metrics_auth
        self.max_sessions_per_key = max_sessions_per_key
        self.max_text_chars_per_minute_per_key = max_text_chars_per_minute_per_key

    @classmethod
    def from_settings(cls, settings: Settings, shared: SharedState | None = None) -> Auth:
        keys = list(settings.api_keys)
        keys_file = settings.api_keys_file
        if keys_file is not None:
            try:
                keys += read_keys_file(Path(keys_file))
            except OSError as exc:
                raise AuthConfigError(f"cannot read the API keys file {keys_file}: {exc.strerror}") from None
        return cls(
            mode=settings.auth,
            keys=keys,
            token_secret=settings.token_secret.encode() if settings.token_secret else None,
            token_ttl_s=settings.token_ttl_s,
            allowed_origins=settings.allowed_origins,
            metrics_auth=settings.metrics_auth,
            max_sessions_per_key=settings.max_sessions_per_key,
            max_text_chars_per_minute_per_key=settings.max_text_chars_per_minute_per_key,
            shared=shared,
            keys_file=None if keys_file is None else str(keys_file),
        )

    @property
    def enabled(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        if not self._auto_on and self.shared.mirror.key_hashes:
            self._auto_on = True
            log.info("auth_on", reason="a key was added to the shared state", shared_keys=len(
                self.shared.mirror.key_hashes))
        if self._auto_on:
            return True
        if self.shared_keys_unknown:  # fail closed: the fleet may have keys this replica has not read yet
            return True
        if self._pending_announced:
            self._pending_announced = False
            log.warning("auth_off", mode=self.mode, reason="the shared state holds no key",
                        message=AUTH_OFF_WARNING)
        return False

    @property
    def shared_keys_unknown(self) -> bool:
        """The shared state (Redis) has not been read since the start: the keys added to it are not known
        here, nor (in `auto`) whether there are any. Meanwhile `auto` is on, and a credential that is not a
        configured key is answered 503 (it may be a valid shared key), not 401."""
        return self.shared.shared and self.shared.mirror.generation < 0

    @property
    def key_count(self) -> int:
        return len(self._key_hashes)

    def announce(self) -> None:
        """The start-up log line: loud when auth is off."""
        if self.mode == "auto" and not self._auto_on and self.shared_keys_unknown:
            self._pending_announced = True
            log.warning("auth_pending", message="the shared state (Redis) is unreachable, so whether the fleet has "
                        "API keys is not known: requests without a configured key are refused (503) until it "
                        "is read")
        elif self.enabled:
            log.info("auth_on", keys=self.key_count, origins=sorted(self.allowed_origins) or "any",
                     max_sessions_per_key=self.max_sessions_per_key,
                     max_text_chars_per_minute_per_key=self.max_text_chars_per_minute_per_key)
        else:
            log.warning("auth_off", mode=self.mode, message=AUTH_OFF_WARNING)

    def status_json(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "mode": self.mode,
            "keys": self.key_count,
            "allowed_origins": sorted(self.allowed_origins),
            "metrics_auth": self.metrics_auth,
            "max_sessions_per_key": self.max_sessions_per_key,
            "max_text_chars_per_minute_per_key": self.max_text_chars_per_minute_per_key,
            "shared_keys": len(self.shared.mirror.key_hashes),
            "revoked_keys": len(self.shared.mirror.revoked_keys),
        }

    # ---- credentials -----------------------------------------------------------------------------

    def check(self, scope: Scope) -> Principal | None:
        """The principal of a request to a protected path (None: auth is off). Raises Denied."""
        origin = _header(scope, b"origin")
        if origin is not None and self.allowed_origins and origin.rstrip("/") not in self.allowed_origins:
            raise Denied(403, "origin_not_allowed", f"origin {origin[:100]!r} is not allowed")
        if not self.enabled:
            return None
        credential = find_credential(scope)
        if credential is None and (_header(scope, b"authorization") or "").strip():
            raise Denied(401, "invalid_authorization", "the Authorization header needs a scheme: "
                         "'Bearer <key>' (or Deepgram's 'Token <key>')")
        if credential is None and self.mode == "auto" and not self._auto_on and self.shared_keys_unknown:
            raise Denied(503, AUTH_UNAVAILABLE, SHARED_KEYS_UNKNOWN + ": whether a key is needed is not known yet")
        if credential is None:
            raise Denied(401, "missing_credentials", "an API key or token is required "
                         "(Authorization: Bearer, X-API-Key, or ?token= in the URL)")
        try:
            return self.verify(credential)
        except Denied as denied:
            if denied.code == "invalid_credentials" and self.shared_keys_unknown:
                raise Denied(503, AUTH_UNAVAILABLE, SHARED_KEYS_UNKNOWN + ": a key added to it cannot be checked "
                             "yet") from None
            raise

    def verify(self, credential: str) -> Principal:
        """A key or a token -> its Principal. Raises Denied (401)."""
        if credential.startswith(TOKEN_PREFIX + ".") and credential.count(".") == 2:
            return self._verify_token(credential)
        if len(credential) > MAX_KEY_CHARS:
            raise Denied(401, "invalid_credentials", "invalid API key")
        digest = key_hash(credential)  # looked up by hash: what the timing of a dict lookup shows is the hash's
        key_id = self._key_hashes.get(digest) or self.shared.key_of_hash(digest)
        if key_id is None or self.shared.key_revoked(key_id):
            raise Denied(401, "invalid_credentials", "invalid API key")
        return Principal(key_id)

    def key_valid(self, key_id: str) -> bool:
        """A fingerprint of a configured or shared key that is not revoked."""
        if self.shared.key_revoked(key_id):
            return False
        return key_id in self._key_hashes.values() or key_id in self.shared.mirror.key_hashes.values()

    def issue_token(self, principal: Principal | None, ttl_s: float | None = None,
                    now_s: float | None = None) -> tuple[str, int]:
        """(token, expires_at unix seconds) standing for the principal's key."""
        ttl_s = self.token_ttl_s if ttl_s is None else min(ttl_s, self.token_ttl_s)
        expires_at = int((time.time() if now_s is None else now_s) + ttl_s)
        key_id = principal.key_id if principal is not None else ANONYMOUS
        token_id = _b64(secrets.token_bytes(TOKEN_ID_BYTES))
        payload = _b64(orjson.dumps({"kid": key_id, "exp": expires_at, "jti": token_id}))
        return f"{TOKEN_PREFIX}.{payload}.{self._sign(payload)}", expires_at

    def read_token(self, token: str) -> tuple[str, str, int]:
        """(key id, token id, expires_at) of a token this server signed (expired or not). Raises Denied."""
        if len(token) > MAX_TOKEN_CHARS or not token.startswith(TOKEN_PREFIX + ".") or token.count(".") != 2:
            raise Denied(401, "invalid_token", "invalid token")
        _, payload, signature = token.split(".")
        if not hmac.compare_digest(self._sign(payload).encode(), signature.encode()):
            raise Denied(401, "invalid_token", "invalid token")
        try:
            claims = orjson.loads(_unb64(payload))
            key_id, expires_at, token_id = claims["kid"], claims["exp"], claims.get("jti", "")
        except (ValueError, TypeError, KeyError):
            raise Denied(401, "invalid_token", "invalid token") from None
        if not isinstance(expires_at, int) or not isinstance(key_id, str) or not isinstance(token_id, str):
            raise Denied(401, "invalid_token", "invalid token")
        return key_id, token_id, expires_at

    async def revoke_token(self, token: str, principal: Principal | None) -> tuple[str, int]:
        """Revoke a token of the caller's own key on every replica: (token id, expires_at). Raises Denied
        (403 for another key's token, 503 while the shared state is unavailable)."""
        key_id, token_id, expires_at = self.read_token(token)
        if key_id != (principal.key_id if principal is not None else ANONYMOUS):
            raise Denied(403, "not_your_token", "a token can be revoked only with its own key (or itself)")
        if not token_id:
            raise Denied(400, "not_revocable", "this token has no id (issued by an older server): let it expire")
        try:
            await self.shared.revoke_token(token_id, float(expires_at))
        except SharedStateUnavailable:
            raise Denied(503, "shared_state_unavailable", "the revocation " + UNCHECKABLE) from None
        log.info("token_revoked", key_id=key_id, token_id=token_id)
        return token_id, expires_at

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, f"{TOKEN_PREFIX}.{payload}".encode(), hashlib.sha256).digest())

    def _verify_token(self, token: str) -> Principal:
        key_id, token_id, expires_at = self.read_token(token)
        if expires_at <= time.time():
            raise Denied(401, "expired_token", "the token has expired: get a new one from POST /v1/tokens")
        if token_id and self.shared.token_revoked(token_id):
            raise Denied(401, "revoked_token", "the token was revoked")
        if not self.key_valid(key_id) and not (key_id == ANONYMOUS and not self.enabled):
            raise Denied(401, "invalid_token", "the token's key is no longer valid")
        return Principal(key_id, via_token=True)

    # ---- per-key limits (in the shared state: they hold across replicas) -----------------------------

    async def acquire_session(self, principal: Principal | None, holder: str) -> str | None:
        """Count session `holder` against its key; a refusal reason when the key is at its limit (or the
        limit cannot be checked). A key without a limit needs no shared state."""
        limit = self.max_sessions_per_key
        if principal is None or not limit:
            return None
        try:
            taken = await self.shared.acquire_lease(SESSIONS_SCOPE + principal.key_id, holder, limit)
        except SharedStateUnavailable:
            return "the per-key session limit " + UNCHECKABLE
        return None if taken else f"too many sessions for this API key (at most {limit})"

    async def release_session(self, principal: Principal | None, holder: str) -> None:
        if principal is not None and self.max_sessions_per_key:
            await self.shared.release_lease(SESSIONS_SCOPE + principal.key_id, holder)

    async def sessions_of(self, principal: Principal) -> int:
        """Live sessions of the principal's key, all replicas (counted only under a session limit)."""
        return await self.shared.lease_count(SESSIONS_SCOPE + principal.key_id)

    async def charge_text(self, principal: Principal | None, chars: int) -> str | None:
        """Take `chars` from the key's per-minute text budget; a refusal reason when it is short
        (then nothing is taken: the text is refused whole) or cannot be checked."""
        limit = self.max_text_chars_per_minute_per_key
        if principal is None or not limit or chars <= 0:
            return None
        try:
            taken = await self.shared.take(TEXT_SCOPE + principal.key_id, chars, limit, limit / SECONDS_PER_MINUTE)
        except SharedStateUnavailable:
            return "the per-key text limit " + UNCHECKABLE
        return None if taken else f"text rate limit: at most {limit} characters per minute for this API key"


def find_credential(scope: Scope) -> str | None:
    """The first credential the request carries (see the module docstring for where)."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers") or []
    found: dict[bytes, str] = {}
    for name, value in headers:
        if name in HEADER_NAMES and name not in found:
            found[name] = value.decode("latin-1").strip()
    authorization = found.get(b"authorization")
    if authorization:
        scheme, _, rest = authorization.partition(" ")
        if rest and scheme.lower() in AUTHORIZATION_SCHEMES:
            return rest.strip()
    for header in HEADER_NAMES[1:]:
        if found.get(header):
            return found[header]
    query = _query(scope)
    for query_name in QUERY_NAMES:
        if query.get(query_name):
            return query[query_name]
    return None


def _query(scope: Scope) -> Mapping[str, str]:
    raw = scope.get("query_string") or b""
    if not raw:
        return {}
    return dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=False))


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope.get("headers") or []:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


def principal_of(scope: Scope) -> Principal | None:
    principal: Principal | None = scope.get(PRINCIPAL_KEY)
    return principal


class AuthMiddleware:
    """Checks every HTTP request and WebSocket handshake (but PUBLIC_PATHS, and METRICS_PATHS unless
    metrics_auth) and answers a refusal itself, with 401 or 403: `refusal(scope, status, code, message)`'s
    response (the app passes the vendors' shapes, protocols.refusal_response), else JSON `{"error": {"code",
    "message"}}`; for a WebSocket, as the HTTP response to the handshake (no upgrade), or a close before accept
    (uvicorn turns that into 403) where the server lacks the denial-response extension."""

    def __init__(self, app: ASGIApp, auth: Auth, refusal: Refusal | None = None) -> None:
        self.app = app
        self.auth = auth
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            scope[PRINCIPAL_KEY] = self.auth.check(scope)
        except Denied as denied:
            log.info("auth_denied", path=scope["path"], code=denied.code, status=denied.status_code,
                     client=_client(scope), websocket=scope["type"] == "websocket")
            shaped = self.refusal(scope, denied.status_code, denied.code, denied.message) if self.refusal else None
            await _deny(scope, receive, send, denied, shaped)
            return
        await self.app(scope, receive, send)

    def _is_open(self, path: str) -> bool:
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return True
        return path in METRICS_PATHS and not self.auth.metrics_auth


async def _deny(scope: Scope, receive: Receive, send: Send, denied: Denied, shaped: Response | None) -> None:
    response = shaped or _error(denied.status_code, denied.code, denied.message)
    if denied.status_code == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    elif denied.status_code == 503:
        response.headers["Retry-After"] = "5"
    if scope["type"] == "http" or "websocket.http.response" in (scope.get("extensions") or {}):
        await response(scope, receive, send)
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": denied.code})


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


# ---- POST /v1/tokens -------------------------------------------------------------------------------


async def issue_token(request: Request) -> Response:
    """A short-lived token for a browser, minted with an API key (not with another token)."""
    auth: Auth = request.app.state.hub.auth
    principal = principal_of(request.scope)
    if principal is not None and principal.via_token:
        return _error(403, "key_required", "a token cannot mint tokens: use an API key")
    ttl_s: float | None = None
    body = await request.body()
    if body.strip():
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _error(400, "bad_request", "the body must be JSON (or empty)")
        raw_ttl = obj.get("ttl_s") if isinstance(obj, dict) else None
        if isinstance(obj, dict) and set(obj) - {"ttl_s"}:
            return _error(400, "bad_request", "the body takes only ttl_s")
        if raw_ttl is not None:
            if (isinstance(raw_ttl, bool) or not isinstance(raw_ttl, (int, float))
                    or not 1 <= raw_ttl <= auth.token_ttl_s):
                return _error(400, "bad_request", f"ttl_s must be a number in [1, {auth.token_ttl_s:g}]")
            ttl_s = float(raw_ttl)
    now_s = time.time()
    token, expires_at = auth.issue_token(principal, ttl_s, now_s)
    _, token_id, _ = auth.read_token(token)
    return JSONResponse({"token": token, "expires_at": expires_at, "expires_in_s": expires_at - int(now_s),
                         "token_id": token_id}, headers={"Cache-Control": "no-store"})


async def revoke_token(request: Request) -> Response:
    """`{"token": "v1...."}`: that token (of the caller's own key) is refused by every replica from now on
    (the others within one shared-state sync period). Idempotent."""
    auth: Auth = request.app.state.hub.auth
    try:
        obj = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        return _error(400, "bad_request", "the body must be JSON: {\"token\": \"...\"}")
    if not isinstance(obj, dict) or set(obj) != {"token"} or not isinstance(obj["token"], str):
        return _error(400, "bad_request", "the body takes exactly one field: token (a string)")
    try:
        token_id, expires_at = await auth.revoke_token(obj["token"], principal_of(request.scope))
    except Denied as denied:
        status = 400 if denied.status_code == 401 else denied.status_code  # a bad token in the body is a bad request
        return _error(status, denied.code, denied.message)
    return JSONResponse({"revoked": True, "token_id": token_id, "expires_at": expires_at})


def _error(status_code: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status_code)
