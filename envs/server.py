"""serve a registered env over HTTP: AgentGym's endpoints plus snapshots (omrl env serve)

``omrl env serve --env game24 --host 127.0.0.1 --port 8000`` serves one registered env with
FastAPI and uvicorn. The endpoints speak AgentGym's ``id`` dialect (``/create``, ``/reset``,
``/step``, ``/observation``, ``/close``, as its BabyAI, SciWorld and TextCraft servers do), so
AgentGym clients work unchanged, and add what a tree search needs: ``/snapshot``, ``/restore``,
``/fork``, ``/valid_actions``, ``/expert_action``, ``/heuristic``, ``/info`` and ``/health``. The
OpenAPI schema is at ``/openapi.json`` (browsable at ``/docs``).

Snapshots stay on the server: ``/snapshot`` stores one and answers an opaque ``snapshot_id``
(``"snapshot": true`` on ``/reset`` and ``/step`` does the same in that call). The store keeps
the ``--max-snapshots`` most recently used ones and frees an env's snapshots when it closes; an
evicted id answers 404, and :class:`envs.remote.RemoteEnv` then restores by replay instead.

Unlike AgentGym (which answers errors with status 200), errors are ``{"error": message}`` with a
4xx status: 400 malformed JSON, 404 unknown env or snapshot id, 409 a step before ``/reset`` or
after the episode ended, 410 an env that was closed or expired, 422 a bad field, task index or
task, 503 the live-env cap reached; 500 when the env itself raised (the server goes on serving).
Each env has its own lock (envs are not thread-safe; FastAPI runs these sync endpoints in a
thread pool), so concurrent clients on different envs step in parallel. An env unused for
``--idle-timeout`` seconds is closed.
"""
import argparse
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from omrl_search.env import env_class
from omrl_search.types import Task

from ._env_pool import PROTOCOL, ApiError, EnvPool

MAX_ACTION_CHARS = 100_000


def task_from_body(env: str, body: dict[str, Any]) -> Task:
    """A full task dict (the fields of :class:`~omrl_search.types.Task`) as a Task of ``env``."""
    if body.get("env") not in (None, env):
        raise ApiError(422, f"task is for env {body['env']!r}, this server serves {env!r}")
    return Task(env=env, task_id=body["task_id"], split=body["split"], seed=body["seed"],
                instruction=body["instruction"], data=body["data"])


# --- the FastAPI app -------------------------------------------------------------------------
def create_app(env: str, *, max_envs: int = 64, idle_timeout: float = 600.0,
               max_snapshots: int = 20_000, clock: Callable[[], float] = time.monotonic):
    """The FastAPI app serving ``env`` (models are built here so importing this module is cheap)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field
    from starlette.exceptions import HTTPException

    pool = EnvPool(env, max_envs=max_envs, idle_timeout=idle_timeout, max_snapshots=max_snapshots,
                   clock=clock)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        pool.close_all()

    app = FastAPI(title=f"omrl env server: {env}", version=PROTOCOL, lifespan=lifespan,
                  description="AgentGym's id-dialect endpoints plus snapshots; errors are "
                              "{\"error\": message} with a 4xx/5xx status.")
    app.state.pool = pool

    class EnvRef(BaseModel):
        id: int = Field(description="the env id /create answered")

    class TaskBody(BaseModel):
        env: str | None = None
        task_id: str
        split: str = "test"
        seed: int = 0
        instruction: str = ""
        data: dict[str, Any] = {}

    class ResetBody(EnvRef):
        data_idx: int | None = Field(None, description="index into the env's task list of `split`")
        split: str = "test"
        task: TaskBody | None = Field(None, description="a full task instead of data_idx")
        snapshot: bool = Field(False, description="also store a snapshot of the new state")

    class StepBody(EnvRef):
        action: str = Field(max_length=MAX_ACTION_CHARS)
        snapshot: bool = Field(False, description="also store a snapshot of the new state")

    class RestoreBody(EnvRef):
        snapshot_id: str

    class ForkBody(EnvRef):
        snapshot_id: str | None = None

    class Created(BaseModel):
        id: int
        env: str

    class ResetOut(BaseModel):
        id: int
        observation: str
        reward: float
        score: float
        done: bool
        task_id: str
        instruction: str
        state_key: str
        snapshot_id: str | None = None

    class StepOut(BaseModel):
        observation: str
        reward: float
        score: float = Field(description="reward summed over the episode")
        done: bool
        info: dict[str, Any]
        state_key: str
        snapshot_id: str | None = None

    class SnapshotOut(BaseModel):
        snapshot_id: str
        state_key: str
        observation: str

    class RestoreOut(BaseModel):
        observation: str
        state_key: str
        score: float
        done: bool

    class ForkOut(RestoreOut):
        id: int

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError):
        return error(exc.status, str(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(_req: Request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail))

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

    @app.post("/create", response_model=Created, summary="create an env (no body needed)")
    def create():
        return {"id": pool.create(), "env": env}

    @app.post("/reset", response_model=ResetOut, response_model_exclude_none=True,
              summary="start a task: data_idx into the split's task list, or a full task")
    def reset(body: ResetBody):
        if (body.data_idx is None) == (body.task is None):
            raise ApiError(422, "give either data_idx (with split) or task, not both or neither")
        task = (pool.task_at(body.data_idx, body.split) if body.task is None
                else task_from_body(env, body.task.model_dump()))
        return pool.reset(body.id, task, body.snapshot)

    @app.post("/step", response_model=StepOut, response_model_exclude_none=True)
    def step(body: StepBody):
        return pool.step(body.id, body.action, body.snapshot)

    @app.get("/observation", response_model=str, summary="the current observation (a string)")
    def observation(id: int):  # noqa: A002 - AgentGym's query parameter name
        return pool.observation(id)

    @app.post("/close")
    def close(body: EnvRef) -> dict[str, Any]:
        pool.close(body.id)
        return {"id": body.id, "closed": True}

    @app.post("/snapshot", response_model=SnapshotOut, summary="store a snapshot on the server")
    def snapshot(body: EnvRef):
        return pool.snapshot(body.id)

    @app.post("/restore", response_model=RestoreOut, summary="restore a stored snapshot")
    def restore(body: RestoreBody):
        return pool.restore(body.id, body.snapshot_id)

    @app.post("/fork", response_model=ForkOut, summary="a new env in this env's state")
    def fork(body: ForkBody):
        return pool.fork(body.id, body.snapshot_id)

    @app.get("/valid_actions", summary="admissible actions (null when the env cannot list them)")
    def valid_actions(id: int) -> list[str] | None:  # noqa: A002
        return pool.query(id, "valid_actions")

    @app.get("/expert_action", summary="the expert solver's next action (null if none)")
    def expert_action(id: int) -> str | None:  # noqa: A002
        return pool.query(id, "expert_action")

    @app.get("/heuristic", summary="the env's heuristic value of the state (404 if it has none)")
    def heuristic(id: int) -> float:  # noqa: A002
        return pool.query(id, "heuristic")

    @app.get("/info", summary="the env's name, action syntax, horizon and capabilities")
    def info() -> dict[str, Any]:
        return pool.info()

    @app.get("/health")
    def health() -> dict[str, Any]:
        return pool.health()

    return app


# --- the `omrl env` sub-command --------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="env_command", required=True)
    s = sub.add_parser("serve", help="serve one registered env over HTTP (AgentGym's protocol + snapshots)")
    s.add_argument("--env", required=True, help="registered env name (see `omrl envs`)")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-envs", type=int, default=64, help="live envs at most (default 64)")
    s.add_argument("--idle-timeout", type=float, default=600.0,
                   help="close an env unused for this many seconds (default 600)")
    s.add_argument("--max-snapshots", type=int, default=20_000,
                   help="stored snapshots kept, least recently used evicted (default 20000)")
    s.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")


def run(args: argparse.Namespace) -> int:
    from omrl_search.cli import UsageError

    env_class(args.env)  # KeyError: one line naming the known envs
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    for flag, value in (("--max-envs", args.max_envs), ("--idle-timeout", args.idle_timeout),
                        ("--max-snapshots", args.max_snapshots)):
        if value <= 0:
            raise UsageError(f"{flag} must be > 0, got {value:g}")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise UsageError(f"omrl env serve needs {exc.name}: pip install 'omrl-search[serve]'") from None
    app = create_app(args.env, max_envs=args.max_envs, idle_timeout=args.idle_timeout,
                     max_snapshots=args.max_snapshots)
    print(f"serving env {args.env} on http://{args.host}:{args.port} (max {args.max_envs} envs, "
          f"idle timeout {args.idle_timeout:g} s); API docs at /docs", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
