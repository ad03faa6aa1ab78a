"""serve a registered env over HTTP: AgentGym's endpoints plus snapshots (omrl env serve)

``omrl env serve --env game24 --host 127.0.0.1 --port 8000`` serves one registered env with
FastAPI and uvicorn. The endpoints speak AgentGym's ``id`` dialect (``/create``, ``/reset``,
``/step``, ``/observation``, ``/close``, as its BabyAI, SciWorld and TextCraft servers do) and,
for ``babyai``, ``sciworld`` and ``webshop``, the dialect of that env's own AgentGym server (the
goal in BabyAI's first observation, SciWorld's ``task_description`` and 0-100 score, WebShop's
``env_idx``; :mod:`envs._agentgym`), so AgentGym clients work unchanged; ``/create`` answers the
first observation as TextCraft's does, and any ``data_idx`` >= 0 is a task (modulo the split).
They add what a tree search needs: ``/snapshot``, ``/restore``,
``/fork``, ``/valid_actions``, ``/expert_action``, ``/heuristic``, ``/info`` and ``/health``. The
OpenAPI schema is at ``/openapi.json`` (browsable at ``/docs``).

Snapshots stay on the server: ``/snapshot`` stores one and answers an opaque, unguessable
``snapshot_id`` (``"snapshot": true`` on ``/reset`` and ``/step`` does the same in that call). An id
works only for the env that made it and the envs forked from it; for any other env it answers
404, as an unknown one does. The store keeps the ``--max-snapshots`` most recently used ones and
frees an env's snapshots when it closes; an evicted id answers 404, and
:class:`envs.remote.RemoteEnv` then restores by replay instead.

A full task on ``/reset`` is checked by the env's own ``task_from_dict`` (a 422 naming what is
wrong), as a task file would be. Request bodies over ``--max-body-mb`` are refused (413) before
they are read; each request's env work gets ``--call-timeout`` seconds (then 504, and the env is
discarded); ``--token`` (or ``$OMRL_ENV_SERVER_TOKEN``) requires a bearer token. Body fields are
strictly typed (``{"id": false}`` and ``{"id": "0"}`` are refused). See docs/reliability.md.

Unlike AgentGym (which answers errors with status 200), errors are ``{"error": message}`` with a
4xx/5xx status (:data:`ERRORS`, each listed in the OpenAPI spec): 400 malformed JSON, 401 no or a
wrong token, 404 unknown env or snapshot id, 405 a wrong method (with ``Allow``), 409 a step
before ``/reset`` or after the episode ended, 410 an env that was closed, expired or discarded,
413 a body too large, 422 a bad field, task index or task, 503 the live-env cap reached, 504 env
work past the time limit; 500 when the env itself raised (the server goes on serving). Each env
has its own lock (envs are not thread-safe; its work runs on the pool's worker threads), so
concurrent clients on different envs step in parallel. An env unused for ``--idle-timeout``
seconds is closed.
"""
import argparse
import json
import os
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from omrl_search.env import env_class

from ._agentgym import hello, only_looks, served
from ._env_pool import PROTOCOL, ApiError, EnvPool
from .server_limits import MAX_READING, READ_TIMEOUT, bounded_http

_QUERIES = ("observation", "valid_actions", "expert_action", "heuristic")  # GET ?id=
MAX_BODY_MB = 4.0
TOKEN_VAR = "OMRL_ENV_SERVER_TOKEN"  # the bearer token, when --token is not given
#: every status the server answers besides 200, for the OpenAPI spec
ERRORS = {400: "malformed JSON body", 401: "missing or wrong bearer token (--token)",
          404: "unknown env id, snapshot id or path", 405: "method not allowed (see Allow)",
          409: "step before /reset or after the episode ended; the env refused the call",
          410: "the env was closed, expired or discarded", 413: "request body over --max-body-mb",
          422: "a field, task index or task failed validation",
          500: "the env itself raised (the server goes on serving)",
          503: "env cap reached, or the env is busy with another request",
          504: "the env's work ran past --call-timeout (the env is discarded)"}


# --- ASGI middleware: a bearer token, then a body limit, both before any body is read --------
async def _send_error(send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if status == 413:
        head.append((b"connection", b"close"))  # the rest of the body is never read
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class BearerToken:
    """401 unless the request carries ``Authorization: Bearer <token>`` (compared in constant time)."""

    def __init__(self, app, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                return await _send_error(send, 401, "missing or wrong bearer token: send the header "
                                         "'Authorization: Bearer <token>' (omrl env serve --token)",
                                         {"WWW-Authenticate": "Bearer"})
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a request body over ``limit`` bytes: at once from its Content-Length, else as soon
    as the bytes received pass it (chunked bodies), so a huge body is never held in memory."""

    def __init__(self, app, limit: int, error: type[Exception]):
        self.app, self.limit, self.error = app, limit, error  # error: starlette's HTTPException

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _send_error(send, 400, f"bad Content-Length {declared[:40]!r}")
            if int(declared) > self.limit:
                return await _send_error(send, 413, self._message(int(declared)))
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                # an HTTPException: FastAPI passes it on from reading the body, to our handler
                raise self.error(413, self._message(seen, "at least "))
            return message

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except self.error as exc:  # raised outside FastAPI's own handling
            if started or exc.status_code != 413:
                raise
            await _send_error(send, 413, str(exc.detail))

    def _message(self, size: int, more: str = "") -> str:
        return (f"request body of {more}{size} bytes is over the limit of {self.limit} bytes "
                "(omrl env serve --max-body-mb)")


# --- the FastAPI app -------------------------------------------------------------------------
def install_error_handlers(app) -> None:
    """Every error the app answers as ``{"error": message}`` with its status: our ApiError,
    starlette's HTTP errors (404 path, 405 with Allow, 413), a bug of ours (500), and request
    validation (400 malformed JSON, 422 a bad field)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError):
        return error(exc.status, str(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(_req: Request, exc: HTTPException):  # 404 path, 405 (with Allow), 413
        return error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_req: Request, exc: Exception):  # a bug of ours: still one JSON line
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_req: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            e = next(e for e in errors if e.get("type") == "json_invalid")
            return error(400, f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
        parts = [f"{'.'.join(str(p) for p in e['loc'][1:]) or e['loc'][0]}: {e['msg']}" for e in errors]
        return error(422, "bad request: " + "; ".join(parts))


def create_app(env: str, *, max_envs: int = 64, idle_timeout: float = 600.0,
               max_snapshots: int = 20_000, call_timeout: float = 60.0,
               max_body_bytes: int = int(MAX_BODY_MB * 2**20), token: str | None = None,
               trust_tasks: bool = False, clock: Callable[[], float] = time.monotonic):
    """The FastAPI app serving ``env``: its pool, middleware, error answers and routes (the
    bodies are in :mod:`envs.server_models`, imported here so importing this module is cheap).

    ``token``: require ``Authorization: Bearer <token>`` on every request (None: no auth)."""
    from fastapi import Body, Depends, FastAPI
    from starlette.exceptions import HTTPException

    from .server_models import (Closed, CreateBody, Created, ErrorOut, ForkOut, ResetOut,
                                RestoreOut, SnapshotOut, StepOut, request_bodies)

    pool = EnvPool(env, max_envs=max_envs, idle_timeout=idle_timeout, max_snapshots=max_snapshots,
                   call_timeout=call_timeout, trust_tasks=trust_tasks, clock=clock)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        pool.close_all()

    app = FastAPI(title=f"omrl env server: {env}", version=PROTOCOL, lifespan=lifespan,
                  generate_unique_id_function=lambda route: route.name,  # operationIds for links
                  description="AgentGym's id-dialect endpoints plus snapshots; errors are "
                              "{\"error\": message} with a 4xx/5xx status.")
    app.state.pool = pool
    app.add_middleware(BodyLimit, limit=max_body_bytes, error=HTTPException)
    if token:
        app.add_middleware(BearerToken, token=token)  # added last: runs first

    def answers(*codes: int, links: dict[str, Any] | None = None) -> dict[int | str, dict[str, Any]]:
        """The route's error answers for the spec, and its OpenAPI links (what a client, or a
        fuzzer, can call next with the ids it answered)."""
        codes += (401,) if token else ()
        out: dict[int | str, dict[str, Any]] = {
            c: {"model": ErrorOut, "description": ERRORS[c]} for c in sorted(codes)}
        if links:
            out[200] = {"links": links}
        return out

    def link(op: str, env_id: str, **body: str) -> dict[str, Any]:
        if op in _QUERIES:
            return {"operationId": op, "parameters": {"query.id": env_id}}
        return {"operationId": op, "requestBody": {"id": env_id, **body}}

    def live(env_id: str, snapshot_id: str | None = None) -> dict[str, Any]:
        out = {op: link(op, env_id) for op in ("step", "snapshot", "fork", "close", *_QUERIES)}
        if snapshot_id:
            out["restore"] = link("restore", env_id, snapshot_id=snapshot_id)
        return out

    posted = (400, 413, 422)  # any POST with a body
    on_env = (404, 410, 500, 503, 504)  # any call on an env id

    webshop = served(env) == "WebShop"  # WebShop's env_idx dialect besides the id one
    EnvRef, ResetBody, StepBody, RestoreBody, ForkBody = request_bodies(webshop)

    install_error_handlers(app)

    def either_id(id: int | None = None, env_idx: int | None = None) -> int:  # noqa: A002
        """The env id of a GET query on the webshop server: ``?id=`` or ``?env_idx=`` (WebShop)."""
        if (id is None) == (env_idx is None):
            raise ApiError(422, "bad request: give the env id as the query parameter id (or "
                                "env_idx, WebShop's name for it), once")
        return id if id is not None else env_idx

    def just_id(id: int) -> int:  # noqa: A002 - AgentGym's query parameter name
        return id

    env_id = either_id if webshop else just_id

    @app.get("/", response_model=str, summary="which env this serves, as AgentGym's servers say it")
    def root():
        return hello(env)

    @app.post("/create", response_model=int if webshop else Created, response_model_exclude_none=True,
              responses=answers(400, 413, 422, 503, 504, links=None if webshop else {
                  "reset": link("reset", "$response.body#/id", data_idx=0, snapshot=True),
                  "close": link("close", "$response.body#/id")}),
              summary="create an env: its id and first observation (WebShop: the bare id)")
    def create(body: CreateBody | None = Body(None)):
        if webshop:
            return pool.start(first_episode=False)["id"]
        return {"env": env, **pool.start(first_episode=body is None or body.first_episode)}

    @app.post("/reset", response_model=ResetOut | list[str | None] if webshop else ResetOut,
              response_model_exclude_none=True,
              responses=answers(*posted, *on_env, 409, links=live("$response.body#/id",
                                                                   "$response.body#/snapshot_id")),
              summary="start a task: data_idx into the split's task list, or a full task")
    def reset(body: ResetBody):
        index = body.data_idx if body.data_idx is not None else body.session_id  # or a task
        task = None if body.task is None else body.task.model_dump()
        out = pool.reset(body.ref, task=task, data_idx=index, split=body.split, snapshot=body.snapshot)
        return (out["observation"], None) if body.env_idx is not None else out  # WebShop's answer

    @app.post("/step", response_model=StepOut, response_model_exclude_none=True,
              responses=answers(*posted, *on_env, 409, links=live("$request.body#/id",
                                                                   "$response.body#/snapshot_id")))
    def step(body: StepBody):
        looks = only_looks(env, body.action) and not body.snapshot
        out = pool.look(body.ref) if looks else pool.step(body.ref, body.action, body.snapshot)
        return {**out, "state": out["observation"]} if body.env_idx is not None else out

    @app.get("/observation", response_model=str, responses=answers(422, *on_env, 409),
             summary="the current observation (a string)")
    def observation(idx: int = Depends(env_id)):
        return pool.observation(idx)

    @app.post("/close", response_model=Closed, responses=answers(*posted, 404, 410, 503))
    def close(body: EnvRef):
        pool.close(body.ref)
        return {"id": body.ref, "closed": True}

    @app.post("/snapshot", response_model=SnapshotOut, responses=answers(
              *posted, *on_env, 409, links=live("$request.body#/id", "$response.body#/snapshot_id")),
              summary="store a snapshot on the server (usable by this env and its forks)")
    def snapshot(body: EnvRef):
        return pool.snapshot(body.ref)

    @app.post("/restore", response_model=RestoreOut, responses=answers(*posted, *on_env, 409),
              summary="restore a stored snapshot of this env or its family")
    def restore(body: RestoreBody):
        return pool.restore(body.ref, body.snapshot_id)

    @app.post("/fork", response_model=ForkOut,
              responses=answers(*posted, *on_env, 409, links=live("$response.body#/id")),
              summary="a new env in this env's state")
    def fork(body: ForkBody):
        return pool.fork(body.ref, body.snapshot_id)

    @app.get("/valid_actions", responses=answers(422, *on_env, 409),
             summary="admissible actions (null when the env cannot list them)")
    def valid_actions(idx: int = Depends(env_id)) -> list[str] | None:
        return pool.query(idx, "valid_actions")

    @app.get("/expert_action", responses=answers(422, *on_env, 409),
             summary="the expert solver's next action (null if none)")
    def expert_action(idx: int = Depends(env_id)) -> str | None:
        return pool.query(idx, "expert_action")

    @app.get("/heuristic", responses=answers(422, *on_env, 409),
             summary="the env's heuristic value of the state (404 if it has none)")
    def heuristic(idx: int = Depends(env_id)) -> float:
        return pool.query(idx, "heuristic")

    if webshop:
        @app.get("/available_actions", responses=answers(422, *on_env, 409),
                 summary="WebShop: {has_search_bar, clickables} of the current page")
        def available_actions(idx: int = Depends(env_id)) -> dict[str, Any]:
            listed = pool.query(idx, "valid_actions") or []
            search = any(a.startswith("search[") for a in listed)
            clicks = [a[len("click["):-1] for a in listed if a.startswith("click[") and a.endswith("]")]
            return {"has_search_bar": search, "clickables": ["search"] * search + clicks}

        @app.get("/instruction_text", response_model=str, responses=answers(422, *on_env, 409),
                 summary="WebShop: the instruction of the current task")
        def instruction_text(idx: int = Depends(env_id)):
            return pool.instruction(idx)

    @app.get("/info", responses=answers(), summary="the env's name, action syntax, horizon and capabilities")
    def info() -> dict[str, Any]:
        return pool.info()

    @app.get("/health", responses=answers())
    def health() -> dict[str, Any]:
        return pool.health()

    if token:
        _document_token(app)
    return app


def _document_token(app) -> None:
    """The bearer scheme in the spec (FastAPI does not know about the middleware)."""
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            spec = base()
            spec.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}}
            spec["security"] = [{"bearer": []}]
        return app.openapi_schema

    app.openapi = openapi


# --- the `omrl env` sub-command --------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="env_command", required=True)
    s = sub.add_parser("serve", help="serve one registered env over HTTP (AgentGym's protocol + snapshots)")
    s.add_argument("--env", required=True, help="registered env name (see `omrl envs`)")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; for any "
                   "other set a token, see docs/reliability.md)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-envs", type=int, default=64, help="live envs at most (default 64)")
    s.add_argument("--idle-timeout", type=float, default=600.0,
                   help="close an env unused for this many seconds (default 600)")
    s.add_argument("--max-snapshots", type=int, default=20_000,
                   help="stored snapshots kept, least recently used evicted (default 20000)")
    s.add_argument("--call-timeout", type=float, default=60.0,
                   help="seconds of env work per request; past it 504 and the env is discarded "
                        "(default 60)")
    s.add_argument("--max-body-mb", type=float, default=MAX_BODY_MB,
                   help=f"largest request body in MiB; past it 413 (default {MAX_BODY_MB:g})")
    s.add_argument("--token", default=None,
                   help=f"require 'Authorization: Bearer TOKEN' on every request (default: ${TOKEN_VAR} "
                        "if set, else no auth; the variable keeps it out of `ps`)")
    s.add_argument("--trust-tasks", action="store_true",
                   help="accept full task dicts for an env without task_from_dict (unchecked)")
    s.add_argument("--read-timeout", type=float, default=READ_TIMEOUT,
                   help="seconds a request's headers and body may take to arrive; past it the "
                        f"connection is closed (default {READ_TIMEOUT:g})")
    s.add_argument("--max-reading", type=int, default=MAX_READING,
                   help="connections part-way through a request at once; one more closes the one "
                        f"reading longest (default {MAX_READING})")
    s.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")


def run(args: argparse.Namespace) -> int:
    import math

    from omrl_search.cli import UsageError

    env_class(args.env)  # KeyError: one line naming the known envs
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    for flag, value in (("--max-envs", args.max_envs), ("--idle-timeout", args.idle_timeout),
                        ("--max-snapshots", args.max_snapshots), ("--call-timeout", args.call_timeout),
                        ("--max-body-mb", args.max_body_mb), ("--read-timeout", args.read_timeout),
                        ("--max-reading", args.max_reading)):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} must be a number > 0, got {value:g}")
    token = args.token if args.token is not None else os.environ.get(TOKEN_VAR) or None
    if token is not None and (len(token) < 16 or not token.isprintable() or " " in token):
        raise UsageError(f"--token must be at least 16 printable characters without spaces "
                         f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise UsageError(f"omrl env serve needs {exc.name}: pip install 'omrl-search[serve]'") from None
    app = create_app(args.env, max_envs=args.max_envs, idle_timeout=args.idle_timeout,
                     max_snapshots=args.max_snapshots, call_timeout=args.call_timeout,
                     max_body_bytes=int(args.max_body_mb * 2**20), token=token,
                     trust_tasks=args.trust_tasks)
    auth = "bearer token required" if token else "no auth"
    print(f"serving env {args.env} on http://{args.host}:{args.port} (max {args.max_envs} envs, "
          f"idle timeout {args.idle_timeout:g} s, {args.call_timeout:g} s per request, bodies up "
          f"to {args.max_body_mb:g} MiB read within {args.read_timeout:g} s, {auth}); API docs at /docs", flush=True)
    if not token and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: {args.host} is reachable from other machines and anyone there can run "
              f"this env: set --token (or ${TOKEN_VAR}) and put TLS in front (docs/reliability.md)",
              flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                http=bounded_http(args.read_timeout, args.max_reading))
    return 0
