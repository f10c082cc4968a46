"""``asyncgraph ui RUN_DIR...``: a local web dashboard of job runs, live while they run.

It reads only what the runs write into their directories: ``checkpoint.json``
(metrics history, job settings; rewritten after every step), ``history.json`` (when
there is no checkpoint), ``steps.jsonl`` (each step's parameter values and feedback;
where the forwards ran, the cost cap and why a run stopped early),
``traces/step-NNNN.json`` (``--trace``) and the call log named there (``--log-calls``).
No database, no account, nothing leaves the machine: a standard-library HTTP server on
127.0.0.1 serves one self-contained page (HTML, JS and CSS shipped with asyncgraph, no
CDN) and a small JSON API the page polls:

``GET /api/runs``                       the runs given, with their labels, progress and
                                        spending (``run_summary``)
``GET /api/run/<i>``                    metrics per step, parameters per step with a
                                        word-level diff against the step before, feedback
``GET /api/run/<i>/calls/<step>``       the model calls of a step (from the call log)
``GET /api/run/<i>/trace/<step>``       a step's Chrome / Perfetto trace

A ``RUN_DIR`` that holds no run files stands for the run folders one or two levels below
it (``find_runs``): ``asyncgraph ui runs`` shows ``runs/a``, ``runs/b``, ``runs/x/seed1``
... by name, numbers in names compared as numbers (``r2`` before ``r10``).

Each run is labelled by its directory (``run_labels``: the last path component, or as
many trailing ones as tell it from the other runs given), the job's name shown beside it:
runs of the same job differ by their directories, not by their names.

NOTE [Dashboard access]: the runs are the user's data (prompts, replies, 0600 files), and
127.0.0.1 is shared by every local user. So, as Jupyter does:

- every request (the page, its script, the API) needs the server's token: a random one
  (``secrets.token_urlsafe``) unless ``--token`` / ``$ASYNCGRAPH_UI_TOKEN`` gives one, in
  the URL it prints (``?token=``), then in a cookie (HttpOnly, SameSite=Strict, named by
  the port) set by the first response to a good token; compared in constant time. Without
  one: 403 and what to open instead;
- requests naming another host than the loopback one are refused (a web page elsewhere
  cannot read the runs through DNS rebinding);
- the browser is opened on a 0600 file that redirects to the URL, not on the URL: a
  browser's command line is visible to other users;
- it reads only regular files whose resolved path lies inside a run directory given
  (``_read_inside``): a symlink out of it, a ``call_log`` named in ``steps.jsonl`` that
  lies elsewhere, a FIFO are refused, not read.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import hmac
import json
import os
import re
import secrets
import stat
import sys
import tempfile
import threading
import webbrowser
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from asyncgraph._files import json_records, json_text, write_credentials

from ._checkpoint import CHECKPOINT_FILE, is_number
from ._record import STEPS_FILE, STOP_REASONS, TRACES_DIR, trace_name

__all__ = [
    "RUN_FILES",
    "add_arguments",
    "find_runs",
    "is_run_dir",
    "load_run",
    "open_ui_server",
    "run",
    "run_labels",
    "run_summary",
    "word_diff",
]

HOST = "127.0.0.1"
_STATIC = {
    "/": "index.html",
    "/index.html": "index.html",
    "/app.js": "app.js",
    "/app.css": "app.css",
}
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
_API = re.compile(r"^/api/run/(\d+)(?:/(calls|trace)/(\d+))?$")
_MAX_DIGITS = 9  # a run or step number; longer ones are refused before int() sees them
_WORDS = re.compile(r"\s+|[^\s]+")
_MAX_DIFF_CHARS = 200_000
TOKEN_ENV = "ASYNCGRAPH_UI_TOKEN"
_MIN_TOKEN_CHARS = 16
_TOKEN = re.compile(rf"[A-Za-z0-9._~-]{{{_MIN_TOKEN_CHARS},}}")
# What makes a folder a run folder: a job writes steps.jsonl as it starts, the checkpoint
# after each step; history.json alone is a run of an older version.
RUN_FILES = (STEPS_FILE, CHECKPOINT_FILE, "history.json")
_DIGITS = re.compile(r"(\d+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def port(text: str) -> int:  # a usage error, not bind()'s OverflowError
        number = int(text) if text.isascii() and text.isdigit() else -1
        if not 0 <= number <= 65535:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 0 to 65535")
        return number

    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="job output directories (--out), or folders holding them one or two levels down",
    )
    parser.add_argument(
        "--port", type=port, default=8765, help="port on 127.0.0.1 (default 8765; 0: any free)"
    )
    parser.add_argument(
        "--no-browser", action="store_true", help="do not open a browser, just print the URL"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"the token every request needs (${TOKEN_ENV}; default: a random one, in the "
        f"URL printed; argv is visible to other users, prefer the variable)",
    )


# -- reading a run ------------------------------------------------------------------


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run folder: it holds one of ``RUN_FILES``."""
    return any(os.path.lexists(path / name) for name in RUN_FILES)


def _name_order(path: Path) -> tuple[list[Any], str]:
    """Sorts names as people do: numbers in them as numbers (``r2`` before ``r10``)."""
    parts = _DIGITS.split(path.name.lower())  # text, digits, text, ...: always aligned
    return [int(p) if k % 2 else p for k, p in enumerate(parts)], path.name


def _folders(path: Path) -> list[Path]:
    """``path``'s subfolders in name order; hidden ones (``.git``) and unreadable ones
    left out."""
    try:
        found = [p for p in path.iterdir() if not p.name.startswith(".") and p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=_name_order)


def find_runs(path: str | Path) -> list[Path]:
    """The run folders that ``path`` stands for: ``[path]`` when it is one (``is_run_dir``),
    else the run folders one level below it, and two levels below it under a subfolder
    that is not a run, in name order, numbers compared as numbers (``runs/r2`` before
    ``runs/r10``, ``runs/a/seed1`` before ``runs/b``); ``[]`` when there are none.

    Example::

        find_runs("runs")   # [Path("runs/r1"), Path("runs/r2"), ..., Path("runs/r11")]
    """
    path = Path(path)
    if is_run_dir(path):
        return [path]
    found = []
    for child in _folders(path):
        if is_run_dir(child):
            found.append(child)
        else:
            found.extend(grandchild for grandchild in _folders(child) if is_run_dir(grandchild))
    return found


def _read_inside(path: Path, roots: Sequence[Path]) -> bytes:
    """The bytes of ``path`` when it is a regular file whose resolved path lies inside one
    of ``roots`` (resolved directories); else ``OSError`` saying why (see NOTE [Dashboard
    access]). A symlink is followed only to a file inside a root."""
    try:
        resolved = path.resolve(strict=True)
    except RuntimeError as exc:  # a symlink loop (Python 3.11, 3.12)
        raise OSError(f"{path}: {exc}") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise PermissionError(f"{path} lies outside the run directories given to asyncgraph ui")
    # Not following a link swapped in since, and not waiting on a FIFO's writer.
    fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise PermissionError(f"{path} is not a regular file")
        return file.read()


def _root(run_dir: Path) -> tuple[Path, ...]:
    return (Path(run_dir).resolve(),)


def _read_json(path: Path, roots: Sequence[Path]) -> Any:
    try:
        return json.loads(_read_inside(path, roots).decode("utf-8"))
    except (OSError, ValueError):
        return None


def _read_lines(run_dir: Path) -> list[dict[str, Any]]:
    """steps.jsonl's lines in the order written: step lines and run events (``_record``)."""
    try:
        return json_records(_read_inside(run_dir / STEPS_FILE, _root(run_dir)).decode("utf-8"))
    except (OSError, ValueError):
        return []


def _steps_of(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step lines, the last one of each step (a step redone after an interrupt)."""
    by_step = {r["step"]: r for r in lines if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def _read_steps(run_dir: Path) -> list[dict[str, Any]]:
    return _steps_of(_read_lines(run_dir))


def word_diff(before: str, after: str) -> list[list[str]]:
    """``after`` against ``before``, word by word: ``[op, text]`` with op ``=``, ``-``, ``+``.

    Words and the whitespace between them are the units; a replaced run of words is
    its deletion then its insertion. Texts longer than 200,000 characters are not
    compared (one ``+`` of the new text).
    """
    if len(before) + len(after) > _MAX_DIFF_CHARS:
        return [["+", after]]
    a, b = _WORDS.findall(before), _WORDS.findall(after)
    out: list[list[str]] = []

    def add(op: str, words: list[str]) -> None:
        if not words:
            return
        text = "".join(words)
        if out and out[-1][0] == op:
            out[-1][1] += text
        else:
            out.append([op, text])

    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            add("=", a[i1:i2])
        else:
            add("-", a[i1:i2])
            add("+", b[j1:j2])
    return out


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=1)


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """A short label per run directory: its last path component, unique among ``run_dirs``.

    Directories sharing their last component are labelled by as many trailing components
    as tell them apart (``a/out`` and ``b/out``); the same directory given twice gets
    ``#2``, ``#3`` after its path. Labels come back in the order of ``run_dirs``.
    """
    parts = [Path(d).parts or (str(d),) for d in run_dirs]
    labels = []
    for mine in parts:
        for n in range(1, len(mine) + 1):
            suffix = mine[-n:]
            if sum(other[-n:] == suffix for other in parts) == 1:
                break
        labels.append(str(Path(*suffix)))
    seen: dict[str, int] = {}
    for k, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            labels[k] = f"{label} #{seen[label]}"
    return labels


def run_summary(
    run_dir: Path, lines: list[dict[str, Any]] | None = None, *, label: str | None = None
) -> dict[str, Any]:
    """What the run list shows of a run directory: label, job name, steps done and total,
    where the forwards of remote Functions ran, and its spending.

    ``label`` is the run's label among the runs shown (``run_labels``); by default the
    directory's last component. ``name`` is the job's name (the directory's when the run
    has no checkpoint yet). ``lines``: steps.jsonl's, when already read. From the newest
    line that says (a resume may run elsewhere, or with another cap, than the run before):
    ``forward_on`` (``"workers"``, ``"in-process"``), ``max_cost_usd`` (the cap, None
    without one). ``stopped``: why the latest run stopped before its last step
    (``"cost_cap"``, ``"interrupted"``, ``"patience"``), None while it runs or once it
    finished; ``stopped_at_cost_cap`` is ``stopped == "cost_cap"``. ``cost_usd``: what
    the job spent by its last checkpoint (a step cut and rolled back included; in
    checkpoints of older versions the last step's total, or the initial validation's
    before any step; None when unknown); ``replayed_calls``: model calls
    replayed from their task's journal instead of paid again; ``cut_calls``: model calls
    cut before their answer (then ``cost_usd`` is an upper bound). Runs recorded before a
    field was kept have None (0 replayed or cut calls, never stopped).
    """
    ckpt = _read_json(run_dir / "checkpoint.json", _root(run_dir))
    history = _history(run_dir, ckpt)
    job = ckpt.get("job", {}) if isinstance(ckpt, dict) else {}
    name = job.get("name") if isinstance(job, dict) else None
    lines = _read_lines(run_dir) if lines is None else lines
    total = next((s.get("total_steps") for s in lines if s.get("step") == 0), None)
    where = _newest(lines, "forward_on")
    cap = _newest(lines, "max_cost_usd")
    stopped = None
    for line in lines:  # the last run's stop, if nothing ran after it
        stopped = line.get("reason") if line.get("event") == "stop" else None
    # Running totals: what the checkpoint says was spent (a cut step's calls included),
    # else (older checkpoints) the last step's row, or the initial validation's.
    totals = ckpt.get("spent") if isinstance(ckpt, dict) else None
    if totals is None:
        totals = history[-1] if history else None
    if totals is None and isinstance(ckpt, dict):
        totals = ckpt.get("initial_usage")
    if not isinstance(totals, dict):
        totals = {}
    spent, replayed, cut = (totals.get(k) for k in ("cost_usd", "replayed_calls", "cut_calls"))
    return {
        "dir": str(run_dir),
        "label": label or run_dir.name or str(run_dir),
        "name": name or run_dir.name,
        "steps_done": len(history),
        "total_steps": total if isinstance(total, int) else None,
        "forward_on": where if where in ("workers", "in-process") else None,
        "max_cost_usd": cap if is_number(cap) else None,
        "cost_usd": spent if is_number(spent) else None,
        "replayed_calls": replayed if is_number(replayed) else 0,
        "cut_calls": cut if is_number(cut) else 0,
        "stopped": stopped if stopped in STOP_REASONS else None,
        "stopped_at_cost_cap": stopped == "cost_cap",
    }


def _newest(lines: list[dict[str, Any]], key: str) -> Any:
    """The value of ``key`` in the last line that has it, else None."""
    return next((line[key] for line in reversed(lines) if key in line), None)


def _history(run_dir: Path, ckpt: Any) -> list[dict[str, Any]]:
    if isinstance(ckpt, dict) and isinstance(ckpt.get("history"), list):
        return [h for h in ckpt["history"] if isinstance(h, dict)]
    saved = _read_json(run_dir / "history.json", _root(run_dir))
    if isinstance(saved, dict) and isinstance(saved.get("history"), list):
        return [h for h in saved["history"] if isinstance(h, dict)]
    return []


def load_run(run_dir: str | Path, *, label: str | None = None) -> dict[str, Any]:
    """Everything the dashboard shows of one run (JSON data); see the module docstring.

    The ``run_summary`` fields (``label`` as given, by default the directory's name), then:

    ``recorded_steps``: the steps the run recorded (in ``steps.jsonl`` or its history),
    ascending: 0 (the start) to its latest; runs of different lengths shown together
    each show their own.

    ``parameters``: one entry per parameter (name in the job's Module, if any, and role;
    in order) with ``steps``: per
    step that recorded it, the value, the ``diff`` against the previous step
    (``word_diff``; None at the first) and the feedback received in that step.
    """
    path = Path(run_dir)
    ckpt = _read_json(path / "checkpoint.json", _root(path))
    history = _history(path, ckpt)
    lines = _read_lines(path)
    steps = _steps_of(lines)
    keys: list[str] = []  # a parameter's dotted name in the job's Module, else its role
    roles: dict[str, str] = {}
    series: dict[str, list[dict[str, Any]]] = {}
    previous: dict[str, str] = {}
    for record in steps:
        feedback = {
            f.get("name") or f.get("role"): f.get("feedback")
            for f in record.get("feedback", [])
            if isinstance(f, dict)
        }
        for item in record.get("parameters", []):
            if not isinstance(item, dict):
                continue
            key = str(item.get("name") or item.get("role", ""))
            if key not in series:
                keys.append(key)
                roles[key] = str(item.get("role", ""))
                series[key] = []
            text = _as_text(item.get("value"))
            series[key].append(
                {
                    "step": record["step"],
                    "value": text,
                    "diff": None if key not in previous else word_diff(previous[key], text),
                    "changed": key in previous and previous[key] != text,
                    "feedback": feedback.get(key),
                }
            )
            previous[key] = text
    call_logs = {r["call_log"] for r in steps if isinstance(r.get("call_log"), str)}
    return {
        **run_summary(path, lines, label=label),
        "job": ckpt.get("job") if isinstance(ckpt, dict) else None,
        "initial_val_score": ckpt.get("initial_val_score") if isinstance(ckpt, dict) else None,
        "history": history,
        "recorded_steps": sorted(
            {r["step"] for r in steps} | {h["step"] for h in history if _is_step(h.get("step"))}
        ),
        "steps": [
            {
                "step": r["step"],
                "time": r.get("time"),
                "trace": r.get("trace"),
                "calls": r.get("calls"),
            }
            for r in steps
        ],
        "parameters": [
            {"name": key if key != roles[key] else "", "role": roles[key], "steps": series[key]}
            for key in keys
        ],
        "call_log": sorted(call_logs)[-1] if call_logs else None,
        "traces": sorted(p.name for p in (path / TRACES_DIR).glob("step-*.json")),
    }


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _step_calls(run_dir: Path, step: int, roots: Sequence[Path]) -> list[dict[str, Any]]:
    """The calls of ``step`` in the run's call log(s); a log shared by runs is filtered.

    A log is read only when it lies inside ``roots`` (the run directories shown): else
    ``PermissionError`` naming it (``steps.jsonl`` may name any file)."""
    logs = {r["call_log"] for r in _read_steps(run_dir) if isinstance(r.get("call_log"), str)}
    calls: list[dict[str, Any]] = []
    for log in sorted(logs):
        try:
            text = _read_inside(Path(log), roots).decode("utf-8", errors="replace")
        except FileNotFoundError:
            continue  # not written yet
        for record in json_records(text):
            labels = record.get("labels")
            if (
                isinstance(labels, dict)
                and labels.get("step") == step
                and labels.get("run", str(run_dir)) == str(run_dir)
            ):
                calls.append(record)
    calls.sort(key=lambda r: r.get("started_at") or 0)
    return calls


# -- the server ---------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    run_dirs: list[Path]
    labels: list[str]
    token: str
    cookie: str  # the cookie's name: one per port, as a browser shares cookies across ports


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "asyncgraph-ui"
    _set_cookie = False  # this answer sets the token's cookie (the request had it in its URL)

    def log_message(self, format: str, *args: Any) -> None:
        return None  # quiet: the terminal shows the URL, not every poll

    def do_GET(self) -> None:
        if not self._local_host():
            self._send(HTTPStatus.FORBIDDEN, b"only http://127.0.0.1 serves this", "text/plain")
            return
        given = self._query_token()
        if not (self._good(given) or self._good(self._cookie_token())):
            self._send(
                HTTPStatus.FORBIDDEN,
                b"asyncgraph ui: this request has no valid token. Open the URL that "
                b"`asyncgraph ui` printed (http://127.0.0.1:PORT/?token=...); the page keeps "
                b"the token in a cookie after that.",
                "text/plain",
            )
            return
        self._set_cookie = self._good(given)
        path = self.path.split("?", 1)[0]
        if path in _STATIC:
            name = _STATIC[path]
            data = resources.files("asyncgraph.jobs").joinpath(f"ui/{name}").read_bytes()
            self._send(HTTPStatus.OK, data, _TYPES[Path(name).suffix])
            return
        if path == "/api/runs":
            runs = zip(self.server.run_dirs, self.server.labels, strict=True)
            self._json({"runs": [run_summary(d, label=label) for d, label in runs]})
            return
        match = _API.match(path)
        if match is not None and any(len(g) > _MAX_DIGITS for g in match.groups("")):
            self._send(HTTPStatus.BAD_REQUEST, b"run or step number out of range", "text/plain")
            return
        if match is None or int(match.group(1)) >= len(self.server.run_dirs):
            self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
            return
        index = int(match.group(1))
        run_dir = self.server.run_dirs[index]
        kind, step = match.group(2), match.group(3)
        if kind is None:
            self._json(load_run(run_dir, label=self.server.labels[index]))
            return
        try:
            if kind == "calls":
                calls = _step_calls(run_dir, int(step), self.server.run_dirs)
                self._json({"step": int(step), "calls": calls})
            else:
                trace = _read_inside(run_dir / trace_name(int(step)), (run_dir,))
                self._send(HTTPStatus.OK, trace, "application/json")
        except PermissionError as exc:
            self._send(HTTPStatus.FORBIDDEN, f"refused: {exc}".encode(), "text/plain")
        except OSError:
            self._send(HTTPStatus.NOT_FOUND, f"no {kind} for this step".encode(), "text/plain")

    def _local_host(self) -> bool:
        host = (self.headers.get("host") or "").rsplit(":", 1)[0].strip("[]").lower()
        return host in ("127.0.0.1", "localhost", "::1")

    def _query_token(self) -> str | None:
        values = parse_qs(urlsplit(self.path).query).get("token")
        return values[-1] if values else None

    def _cookie_token(self) -> str | None:
        try:
            morsel = SimpleCookie(self.headers.get("cookie") or "").get(self.server.cookie)
        except CookieError:
            return None
        return morsel.value if morsel is not None else None

    def _good(self, token: str | None) -> bool:
        if token is None:
            return False
        return hmac.compare_digest(token.encode(), self.server.token.encode())

    def _json(self, payload: Any) -> None:
        # Redacted as every file is (a run directory written before it was, a config).
        data = json_text(payload, allow_nan=False)
        self._send(HTTPStatus.OK, data.encode("utf-8"), "application/json")

    def _send(self, status: HTTPStatus, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("content-type", f"{kind}; charset=utf-8")
        self.send_header("content-length", str(len(data)))
        self.send_header("cache-control", "no-store")
        self.send_header("x-content-type-options", "nosniff")
        self.send_header("referrer-policy", "no-referrer")
        if self._set_cookie:
            self.send_header(
                "set-cookie",
                f"{self.server.cookie}={self.server.token}; Path=/; HttpOnly; SameSite=Strict",
            )
        self.end_headers()
        self.wfile.write(data)


def _check_token(token: str) -> None:
    """Raise ``ValueError`` for a token too short to keep other users out, or with a
    character that would need quoting in a URL or a cookie."""
    if not _TOKEN.fullmatch(token):
        raise ValueError(
            f"the dashboard's token must be {_MIN_TOKEN_CHARS} or more letters, digits, '-', "
            f"'_', '.' or '~' (got {len(token)} characters); leave it out for a random one, "
            f"or make one with `python -c 'import secrets; print(secrets.token_urlsafe())'`"
        )


@contextmanager
def open_ui_server(
    run_dirs: Sequence[str | Path], *, port: int = 0, token: str | None = None
) -> Iterator[str]:
    """Serve the dashboard of ``run_dirs`` on 127.0.0.1 in a thread; yields the URL to open,
    with its token (``http://127.0.0.1:PORT/?token=...``).

    Every request needs ``token`` (default: a random one; see NOTE [Dashboard access]):
    in the URL's query, or the cookie the first answer to it sets. Raises ``ValueError``
    for a token shorter than 16 characters or with other characters than letters,
    digits, ``-``, ``_``, ``.``, ``~``; ``OSError`` when the port is taken.
    """
    token = secrets.token_urlsafe(32) if token is None else token
    _check_token(token)
    server = _Server((HOST, port), _Handler)
    server.run_dirs = [Path(d).resolve() for d in run_dirs]
    server.labels = run_labels(server.run_dirs)
    server.token = token
    server.cookie = f"asyncgraph-ui-{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="asyncgraph-ui", daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}/?token={token}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def _redirect_file(url: str) -> Iterator[Path]:
    """A 0600 HTML file that sends a browser to ``url``: what the browser is opened on, so
    the token is not on a command line other users can read (``ps``)."""
    with tempfile.TemporaryDirectory(prefix="asyncgraph-ui-") as folder:  # 0700
        # Not redacted: the browser needs the token in it (asyncgraph._files).
        yield write_credentials(
            Path(folder) / "open.html",
            f'<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" '
            f'content="0;url={url}"><title>asyncgraph ui</title>'
            f'<p><a href="{url}">Open the dashboard</a>',
        )


def _runs_given(run_dirs: Sequence[str]) -> list[Path]:
    """The run folders the ``RUN_DIR`` arguments stand for (``find_runs``), in their order;
    ``ValueError`` with the one line to print for one that is not a folder, or is neither
    a run folder nor holds any."""
    missing = [d for d in run_dirs if not Path(d).is_dir()]
    if missing:
        raise ValueError(
            f"not a directory: {', '.join(missing)}; give the --out directories of "
            f"`asyncgraph run` / `asyncgraph demo` (a run still starting may not have one yet)"
        )
    found = {d: find_runs(d) for d in run_dirs}
    empty = [d for d, runs in found.items() if not runs]
    if empty:
        raise ValueError(
            f"no run in {', '.join(empty)}: a run folder is the --out directory of "
            f"`asyncgraph run` / `asyncgraph demo` and holds {', '.join(RUN_FILES[:-1])} or "
            f"{RUN_FILES[-1]}; give run folders or folders holding them one or two levels "
            f"down (a run writes {STEPS_FILE} as it starts)"
        )
    return [run for d in run_dirs for run in found[d]]


def run(args: argparse.Namespace) -> int:
    try:
        run_dirs = _runs_given(args.run_dirs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.token is not None:
        try:
            _check_token(args.token)
        except ValueError as exc:
            print(f"error: --token / ${TOKEN_ENV}: {exc}", file=sys.stderr)
            return 2
    try:
        server = open_ui_server(run_dirs, port=args.port, token=args.token)
        url = server.__enter__()
    except OSError as exc:
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be opened ({exc})"
        print(
            f"error: port {args.port} on {HOST} {why}; pick another --port (0: any free one)",
            file=sys.stderr,
        )
        return 1
    try:
        print(f"asyncgraph ui: {url}  ({len(run_dirs)} run(s); Ctrl-C stops)", flush=True)
        with nullcontext() if args.no_browser else _redirect_file(url) as page:
            if page is not None:
                webbrowser.open(page.as_uri())
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.__exit__(None, None, None)
    return 0
