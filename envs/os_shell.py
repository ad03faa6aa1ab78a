"""``os``: answer questions about files and change files with bash, in a bubblewrap sandbox.

Tasks in the style of AgentBench OS (:mod:`envs._os_tasks`): count, find, transform files, fix
permissions, process text. Each ``bash:`` action runs one command in a *fresh* sandbox process
on the work dir (:mod:`envs._sandbox`: no network, read-only system, limits on time, CPU,
memory, processes, file size and output), so the state is the work dir's files and their modes:
``cd``, shell variables and background processes do not outlive a command. ``answer:`` ends the
episode; question tasks compare the answer, file tasks compare the work dir with the expected
files (contents up to a final newline; modes where the task says so; no extra files).

Snapshots are native: a snapshot is the state value itself, whose work dir is an immutable
in-memory tree of every entry (path, kind, mode, bytes), and restoring writes back only the
entries that differ, so it costs far less than a step (one sandbox start).
"""
from __future__ import annotations

import dataclasses
import re
import signal
from typing import Any

from omrl_search.env import NativeSnapshots, register_env, stable_hash
from omrl_search.types import StepResult, Task

from . import _os_tasks
from ._sandbox import HOME, Entry, Limits, Tree, WorkDir, tree_digest
from ._text_env import Episode, TextEnv, episode_over, say, step_result, trying

_BASH = re.compile(r"^(?:bash|sh|shell|run)[ \t]*:[ \t]*(?P<cmd>.*)$", re.S | re.I)
_FENCE = re.compile(r"^```(?:bash|sh|shell)?[ \t]*\n(?P<cmd>.*?)\n?```$", re.S | re.I)
_UNFENCED = re.compile(r"^(?:bash|sh|shell)[ \t]*\n(?P<cmd>.+)$", re.S | re.I)  # a fence minus ```
_ANSWER = re.compile(r"^answer[ \t]*:(?P<text>.*)$", re.S | re.I)
_RUN = ("Running `{cmd}` in the work dir does what the task needs next.",
        "I run `{cmd}` for the next part of the task.", "The command `{cmd}` gets me what the task asks.")
_RUN_LONG = ("This command does what the task needs next in the work dir.",
             "I run one command for the next part of the task.")
_SUBMIT = ("The files are now as the task asks, so I submit them.", "The work dir is as required: done.")
_ANSWERED = ("The command's output gives the answer: {text}.", "From the output, the answer is {text}.")
MAX_COMMAND = 8000
MAX_FILES_IN_TASK = 200


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OsState(Episode):
    """The episode and the work dir after a step."""

    task: Task
    tree: Tree  # the work dir
    digest: str  # tree_digest(tree)
    last: str = ""  # the last command run (the expert answers after its solution ran)


@register_env("os")
class OsEnv(NativeSnapshots, TextEnv):
    """Bash in a sandboxed work dir; state = the work dir's files (see the module docstring).

    ``make_env("os", wall_s=2, ...)`` overrides any field of :class:`~envs._sandbox.Limits`.
    """

    description = ("OS: answer questions about files and change files with bash commands, run in "
                   f"a sandbox (no network) on a work dir ({HOME}).")
    action_help = (
        "Actions: `bash: <command>` runs one command in the work dir and shows its output; each "
        "command starts a fresh shell there, so files persist but `cd` and variables do not (a "
        "longer script can go in a ```bash fenced block). `answer: <text>` ends the task with your "
        "answer; for tasks that change files, `answer: done` submits the files for checking."
    )
    examples = "Think: I count the lines of the file.\nAct: bash: wc -l < notes/apple.txt"
    max_steps = 10

    def __init__(self, limits: Limits | None = None, **overrides: Any):
        self.limits = dataclasses.replace(limits or Limits(), **overrides)
        self.workdir = WorkDir(self.limits)
        self.state: OsState | None = None

    # --- episode -------------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        tree = files_tree(task.data["files"])
        self.workdir.load(tree)
        top = [e.path + ("/" if e.kind == "d" else "") for e in tree if "/" not in e.path]
        where = f"holds: {', '.join(top)}." if top else "is empty."
        obs = f"{task.instruction}\nThe work dir {HOME} {where}"
        self.state = OsState(observation=obs, steps=0, limit=self.max_steps, task=task, tree=tree,
                             digest=tree_digest(tree))
        return self.state.observation

    def step(self, action: str) -> StepResult:
        s = self._require()
        if s.done:
            return episode_over(s)
        kind, arg = parse_action(action)
        info: dict[str, Any] = {}
        tree, digest, last, done, success, answer = s.tree, s.digest, s.last, False, False, ""
        if kind == "bash":
            result, undone = self.workdir.run(arg)
            tree, last = self.workdir.tree, arg
            digest = tree_digest(tree)
            obs = self._render(arg, result, undone)
            info["exit_code"] = result.exit_code
        elif kind == "answer":
            done = True
            success, answer, obs = self._judge(s, arg)
        else:
            obs = self.invalid_note(arg)
        self.state = s = OsState(
            observation=obs, steps=s.steps + 1, limit=s.limit, done=done, success=success,
            answer=answer, task=s.task, tree=tree, digest=digest, last=last,
        ).at_limit(f"[Out of steps ({s.limit}): the task is not solved.]", answer="")
        return step_result(s, s.observation, 1.0 if success else 0.0, valid=kind != "invalid", **info)

    def _render(self, command: str, result, undone: bool) -> str:
        shown = command if len(command) <= 300 else command[:300] + " ..."
        lines = [f"$ {shown}", result.output.rstrip("\n") or "(no output)"]
        lim = self.limits
        if result.stopped == "wall":
            lines.append(f"[stopped: the command ran past the wall-time limit of {lim.wall_s:g} s]")
        elif result.stopped == "output":
            lines.append(f"[stopped: the command wrote more than {lim.stop_output_bytes} bytes]")
        elif result.exit_code in (128 + signal.SIGKILL, 128 + signal.SIGXCPU):
            lines.append(f"[exit code {result.exit_code}: killed (CPU limit {lim.cpu_s} s, memory "
                         f"limit {lim.memory_mb} MiB per process)]")
        else:
            lines.append(f"[exit code {result.exit_code}]")
        if undone:
            lines.append(f"[the work dir grew past {lim.max_files} entries or {lim.max_bytes} "
                         "bytes: the command's changes were undone]")
        return "\n".join(lines)

    def _judge(self, s: OsState, text: str) -> tuple[bool, str, str]:
        data = s.task.data
        if "answer" in data:
            given = normalize_answer(text)
            ok = answers_match(given, data["answer"])
            verdict = "Correct!" if ok else f"Wrong answer: {given!r}."
            return ok, given, f"{verdict} The episode is over."
        problems = check_files(s.tree, data["expected"])
        answer = "files:" + tree_digest(tuple(e for e in s.tree if e.kind != "d"))
        verdict = (f"The files are not as required ({'; '.join(problems[:3])})." if problems
                   else "The files are as required: solved!")
        return not problems, answer, f"{verdict} The episode is over."

    def explain(self, action: str, rng=None) -> str | None:
        """Why the expert's command or answer (another action: a neutral line)."""
        s = self._require()
        kind, arg = parse_action(action)
        if s.done or kind == "invalid":
            return None
        if action.strip() != self.expert_action():
            return trying(action, rng)
        if kind == "answer" and "answer" not in s.task.data:
            return say(rng, _SUBMIT)
        if kind == "answer":
            return say(rng, _ANSWERED, text=arg)
        return say(rng, _RUN if len(arg) <= 80 else _RUN_LONG, cmd=arg)

    def action_grammar(self) -> str | None:
        """One line: ``bash: COMMAND`` or ``answer: TEXT`` (the fenced multi-line form the env
        also reads is left out)."""
        if self._require().done:
            return None
        return 'action ::= "bash: " line | "answer: " line\nline ::= [^ \\n] [^\\n]*'

    def state_key(self) -> str:
        s = self._require()
        return stable_hash((s.task.task_id, s.digest, s.steps, s.done, s.truncated, s.success,
                            s.answer, s.last, s.observation))

    # --- snapshots -----------------------------------------------------------------------------
    def save_native(self) -> OsState:
        return self._require()

    def load_native(self, payload: OsState) -> None:
        self.workdir.load(payload.tree)
        self.state = payload

    # --- expert --------------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The solution command, then the answer; from a state off that path, a command that
        rewrites the work dir into the expected files (file tasks)."""
        s = self.state
        if s is None or s.done:
            return None
        data = s.task.data
        solution = data.get("solution")
        if "answer" in data:
            if solution and s.last != solution:
                return f"bash: {solution}"
            return f"answer: {data['answer']}"
        if not check_files(s.tree, data["expected"]):
            return "answer: done"
        if solution and _file_view(s.tree) == _file_view(files_tree(data["files"])):
            return f"bash: {solution}"
        return f"bash: {repair_command(s.tree, data['expected'])}"

    def close(self) -> None:
        self.workdir.close()

    # --- task sets -----------------------------------------------------------------------------
    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        if split not in _os_tasks.PER_FAMILY:
            raise ValueError(f"os has splits 'train' and 'test', not {split!r}")
        specs = _os_tasks.generated(split)[:limit]
        return [_make_task(spec, task_id, split) for task_id, spec in specs]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        """A user task: ``instruction``, ``files`` ({path: text | {"content", "mode"}}), and either
        ``answer`` or ``expected`` (files, ``mode`` optional); optional ``solution`` (a command
        for the expert), ``task_id`` and ``split``."""
        instruction = row.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise ValueError("instruction must be a non-empty string")
        if ("answer" in row) == ("expected" in row):
            raise ValueError("give exactly one of 'answer' (a question) or 'expected' (the final "
                             "files)")
        files = _check_files(row.get("files", {}), "files", True)
        spec: dict[str, Any] = {"instruction": instruction, "files": files}
        if "answer" in row:
            answer = row["answer"]
            if not isinstance(answer, (str, int, float)) or not str(answer).strip():
                raise ValueError(f"answer must be a non-empty string or number, got {answer!r}")
            spec["answer"] = str(answer)
        else:
            spec["expected"] = _check_files(row["expected"], "expected", False)
        if row.get("solution") is not None:
            if not isinstance(row["solution"], str) or not row["solution"].strip():
                raise ValueError("solution must be a non-empty command string")
            spec["solution"] = row["solution"].strip()
        task_id = row.get("task_id") or "os-" + stable_hash(repr(sorted(spec.items())))
        if not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        return _make_task(spec, task_id, row.get("split", "test"))


def _make_task(spec: dict[str, Any], task_id: str, split: str) -> Task:
    data = {k: v for k, v in spec.items() if k != "instruction"}
    return Task(env="os", task_id=task_id, split=split, seed=0, instruction=spec["instruction"],
                data=data)


# --- actions and checks ----------------------------------------------------------------------
def parse_action(action: str) -> tuple[str, str]:
    """``("bash", command)``, ``("answer", text)`` or ``("invalid", why)``."""
    text = action.strip()
    m = _ANSWER.match(text)
    if m:
        answer = m.group("text").strip()
        return ("answer", answer) if answer else ("invalid", "`answer:` needs a value")
    m = _FENCE.match(text) or _BASH.match(text) or _UNFENCED.match(text)
    if m is None:
        return "invalid", f"cannot parse {text[:60]!r}" if text else "empty action"
    command = m.group("cmd").strip()
    if not command:
        return "invalid", "the command is empty"
    if len(command) > MAX_COMMAND or "\0" in command:
        return "invalid", f"the command must be text of at most {MAX_COMMAND} characters"
    return "bash", command


def normalize_answer(text: str) -> str:
    """One line, no surrounding quotes or final period, paths relative to the work dir."""
    text, before = " ".join(text.split()), None
    while text != before:
        before, text = text, text.strip("`'\" ").removesuffix(".")
    for prefix in (HOME + "/", "./"):
        text = text.removeprefix(prefix)
    return text


def answers_match(given: str, expected: str) -> bool:
    if given == normalize_answer(expected):
        return True
    try:
        return float(given) == float(expected)
    except ValueError:
        return False


def files_tree(files: dict[str, list]) -> Tree:
    """The tree of a task's files (parent dirs 0755), in scan order."""
    entries = {}
    for path, (text, mode) in files.items():
        parts = path.split("/")
        for i in range(1, len(parts)):
            entries.setdefault("/".join(parts[:i]), Entry("/".join(parts[:i]), "d", 0o755, None))
        entries[path] = Entry(path, "f", mode, text.encode())
    return tuple(sorted(entries.values(), key=lambda e: e.path.split("/")))


def _file_view(tree: Tree) -> dict[str, tuple]:
    return {e.path: (e.kind, e.mode, e.data) for e in tree if e.kind != "d"}


def check_files(tree: Tree, expected: dict[str, list]) -> list[str]:
    """What differs between the work dir and the expected files (empty when it matches)."""
    have = {e.path: e for e in tree if e.kind != "d"}
    problems = []
    for path, (text, mode) in expected.items():
        e = have.get(path)
        if e is None or e.kind != "f":
            problems.append(f"{path} is missing" if e is None else f"{path} is not a regular file")
        elif not _same_text(e.data, text):
            problems.append(f"{path} has the wrong content")
        elif mode is not None and e.mode != mode:
            problems.append(f"{path} has mode {e.mode:o}, not {mode:o}")
    extra = sorted(set(have) - set(expected))
    if extra:
        problems.append(f"unexpected files: {', '.join(extra[:5])}")
    return problems


def repair_command(tree: Tree, expected: dict[str, list]) -> str:
    """One command line that turns the work dir into exactly the expected files."""
    have = {e.path: e for e in tree}
    parts = []
    locked = [e.path for e in tree if e.kind == "d" and e.mode & 0o700 != 0o700]
    if locked:
        parts.append("chmod u+rwx -- " + " ".join(map(_quote, locked)))
    clash = {"/".join(p.split("/")[:i]) for p in expected for i in range(1, p.count("/") + 1)}
    doomed = [e.path for e in tree if (e.kind != "d" and e.path not in expected)
              or (e.kind == "d" and e.path in expected)
              or (e.kind != "d" and e.path in clash)]
    if doomed:
        parts.append("rm -rf -- " + " ".join(map(_quote, doomed)))
    dirs = sorted({p.rsplit("/", 1)[0] for p in expected if "/" in p})
    if dirs:
        parts.append("mkdir -p -- " + " ".join(map(_quote, dirs)))
    for path, (text, mode) in expected.items():
        e = have.get(path)
        if e is None or e.kind != "f" or path in doomed or not _same_text(e.data, text):
            parts.append(f"printf {_quote(_printf_format(text.encode()))} > {_quote(path)}")
        if mode is not None and (e is None or e.mode != mode or path in doomed or e.kind != "f"):
            parts.append(f"chmod {mode:o} {_quote(path)}")
    return " && ".join(parts) or "true"


def _same_text(data: bytes, text: str) -> bool:
    """File contents equal up to final newlines (``printf 5`` and ``echo 5`` both count)."""
    return data.rstrip(b"\n") == text.encode().rstrip(b"\n")


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _printf_format(data: bytes) -> str:
    """A printf format string printing exactly ``data`` (one line, escapes for the rest)."""
    out = []
    for b in data:
        ch = chr(b)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "%":
            out.append("%%")
        elif ch == "\n":
            out.append("\\n")
        elif 32 <= b < 127:
            out.append(ch)
        else:
            out.append(f"\\{b:03o}")
    return "".join(out)


def _check_files(files: Any, field: str, need_mode: bool) -> dict[str, list]:
    """``{path: [text, mode]}`` from a user's ``files``/``expected``; raise ValueError if bad."""
    if not isinstance(files, dict) or len(files) > MAX_FILES_IN_TASK:
        raise ValueError(f"{field} must be an object of at most {MAX_FILES_IN_TASK} "
                         "path: content pairs")
    out = {}
    for path, value in files.items():
        parts = path.split("/") if isinstance(path, str) else []
        if not parts or any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise ValueError(f"{field}: {path!r} is not a relative path inside the work dir")
        text, mode = (value, None) if isinstance(value, str) else (
            (value.get("content"), value.get("mode")) if isinstance(value, dict) else (None, None))
        if not isinstance(text, str):
            raise ValueError(f"{field}: {path!r} needs text content (a string or "
                             '{"content": ..., "mode": ...})')
        if isinstance(mode, str):
            mode = int(mode, 8) if re.fullmatch(r"[0-7]{3,4}", mode) else -1
        if mode is not None and (not isinstance(mode, int) or not 0 <= mode <= 0o7777):
            raise ValueError(f"{field}: {path!r} has a bad mode {value.get('mode')!r} "
                             '(octal, e.g. "644")')
        out[path] = [text, 0o644 if mode is None and need_mode else mode]
    prefixes = {"/".join(p.split("/")[:i]) for p in out for i in range(1, p.count("/") + 1)}
    both = sorted(prefixes & set(out))
    if both:
        raise ValueError(f"{field}: {both[0]!r} is both a file and a directory")
    return out
