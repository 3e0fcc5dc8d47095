"""The README cannot rot: every shell block of README.md (and of the documents in DOCUMENTS)
is run, in order, and a command that fails or whose output contradicts what the document
shows fails this test.

Which blocks run. A fenced block whose language is `sh`, `bash`, `shell` or `console` runs;
a block with no language (or any other) is shown, not run -- a transcript from another
machine, a file's content -- unless a marker says `run`. Blocks run in document order, one
test item each (`test_readme.py::test_block[README.md:42]`, 42 the fence's line), in one
temporary working directory per document that holds links to the repository's top-level
files (so `docs/examples/...` and `edgefl/configs/...` resolve) and receives what the
commands write (`runs/`, `model.onnx`, ...). `edgefl` is this interpreter's, with the
repository on PYTHONPATH; decoded data sets are cached for the session (conftest.py).

A block is a script or a transcript. A script is one command per line (`\\` continues a
line; `#` comments are the shell's); each must exit 0. A transcript has commands after
`$ ` and, under each, the output the document shows: every shown line must appear in the
command's output (stdout and stderr together), in that order, with other lines allowed in
between. In a shown line, `...` matches any text, and so do the parts that change from run
to run: durations (`0.04 s`, `0.003s`, `ETA 0s`), clock times (`07:57:46`) and run-directory
stamps (`20261126-133257`). Everything else -- accuracies, counts, hashes, file names --
must be as shown. Shell variables assigned by a command (`C="edgefl ctl ..."`) stay set for
the document's later commands.

Markers. An HTML comment right before a fence (blank lines and other markers may come
between) changes how the block runs; readers of the rendered page do not see it:

    <!-- readme-test: skip REASON -->        not run; REASON is printed (pytest -rs)
    <!-- readme-test: needs-board -->        not run: needs a Raspberry Pi-class board
    <!-- readme-test: needs-root -->         not run: needs root (writes /etc, ...)
    <!-- readme-test: needs-systemd -->      not run: needs systemd as PID 1
    <!-- readme-test: run -->                run a block that has no shell language
    <!-- readme-test: background -->         start each command and go on (after `ready`, or
                                             0.5 s); the process must still be running then
                                             and at the end of the document,
                                             where it gets SIGINT (Ctrl-C) and must exit
                                             cleanly within 15 s
    <!-- readme-test: ready TEXT -->         with background: wait (30 s at most) until the
                                             process has printed TEXT
    <!-- readme-test: fails SUBSTRING -->    the block's commands containing SUBSTRING must
                                             exit non-zero (a documented refusal)
    <!-- readme-test: output any -->         do not compare the shown output
    <!-- readme-test: timeout SECONDS -->    per command (default 120)
    <!-- readme-test: cleanup COMMAND -->     run COMMAND at the end of the document, whatever
                                             happened (best effort, status ignored): stops
                                             what a block started in the background of its
                                             own, e.g. `cleanup edgefl fleet down --dir fleet`
                                             even when a command between failed
    <!-- readme-test: sub OLD => NEW -->     from here to the end of the document, OLD is
                                             replaced by NEW in commands and shown output;
                                             NEW may name {port:NAME} (a free TCP port,
                                             the same for every use of NAME in the
                                             document) or {broker_url} / {broker_host} /
                                             {broker_port} (a fresh Mosquitto from
                                             tests/brokers.py, anonymous, started on first
                                             use; skipped where Mosquitto is not installed)

Several directives may share one comment, separated by `;`. `sub` may stand anywhere (it is
not tied to a fence); a marker that is not followed by a fence, or an unknown directive, is
an error of the document. So is an unmarked command that would change the machine (`pip`,
`sudo`, `apt`, `systemctl`, ...). A command that is slow in the README is a README problem: give it
a small config that is honest rather than skipping it; the whole test should stay under two
minutes.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgefl.transport.broker import find_mosquitto, free_port

REPO = Path(__file__).resolve().parents[1]
# the documents whose shell blocks run, in this order; docs/orchestration.md's run on the
# one-machine fleet that `edgefl fleet up` starts in its temporary directory
DOCUMENTS = ["README.md", "docs/orchestration.md"]
RUNNABLE = {"sh", "bash", "shell", "console"}
SKIPS = {"needs-board": "needs a Raspberry Pi-class board",
         "needs-root": "needs root",
         "needs-systemd": "needs systemd as PID 1"}
DEFAULT_TIMEOUT = 120.0
# never run unmarked: they would change the machine the tests run on (an editable install
# of the test's temporary directory, a package upgrade)
SYSTEM_CHANGING = re.compile(r"^\s*(sudo|apt(-get)?|pip3?|python3? -m pip|systemctl|"
                             r"systemd-sysusers)\b")
MARKER = re.compile(r"^\s*<!--\s*readme-test:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^`]*$")
# parts of shown output that change from run to run (see the module docstring)
VARYING = [
    (re.compile(r"\\\.\\\.\\\."), ".*"),                                    # ...
    (re.compile(r"\d+(\\\.\d+)?(\\ )?s\b"), r"\\d+(\\.\\d+)?\\ ?s"),          # 0.04 s, 3s
    (re.compile(r"\d\d:\d\d:\d\d"), r"\\d\\d:\\d\\d:\\d\\d"),                # 07:57:46
    (re.compile(r"\d{8}(\\)?-\d{6}((\\)?-\d+)?"), r"\\d{8}-\\d{6}(-\\d+)?"),  # run stamps
]


@dataclass
class Command:
    text: str
    shown: list = field(default_factory=list)      # output lines the document shows


@dataclass
class Block:
    document: str
    line: int                    # 1-based line of the opening fence
    language: str
    directives: list             # [(name, argument)] from the markers before the fence
    subs: list                   # [(old, new)] in force at this block
    commands: list

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"

    def directive(self, name: str):
        for key, value in self.directives:
            if key == name:
                return value
        return None

    def all(self, name: str) -> list:
        return [value for key, value in self.directives if key == name]


KNOWN = {"skip", "run", "background", "ready", "fails", "output", "timeout", "sub", "cleanup",
         *SKIPS}


def parse_markers(text: str, where: str) -> list:
    directives = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        name, _, argument = part.partition(" ")
        if name not in KNOWN:
            raise ValueError(f"{where}: unknown readme-test directive {name!r}; known: "
                             f"{', '.join(sorted(KNOWN))}")
        directives.append((name, argument.strip()))
    return directives


def parse_document(document: str) -> list:
    """The document's blocks (runnable or not), with their markers and substitutions."""
    lines = (REPO / document).read_text(encoding="utf-8").splitlines()
    blocks, pending, subs = [], [], []
    pending_line = None
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        if marker:
            directives = parse_markers(marker.group(1), f"{document}:{i + 1}")
            for name, argument in directives:
                if name == "sub":
                    old, arrow, new = argument.partition("=>")
                    if not arrow or not old.strip():
                        raise ValueError(f"{document}:{i + 1}: sub needs 'OLD => NEW'")
                    subs.append((old.strip(), new.strip()))
            rest = [d for d in directives if d[0] != "sub"]
            if rest:
                pending += rest
                pending_line = i + 1
            i += 1
            continue
        fence = FENCE.match(line)
        if fence:
            indent, ticks, language = fence.groups()
            body, j = [], i + 1
            while j < len(lines) and not (lines[j].strip().startswith(ticks) and
                                          lines[j].strip().strip(ticks[0]) == ""):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
                j += 1
            blocks.append(Block(document, i + 1, language.lower(), pending, list(subs),
                                split_commands(body)))
            pending, pending_line = [], None
            i = j + 1
            continue
        if pending and line.strip():
            raise ValueError(f"{document}:{pending_line}: a readme-test marker must come "
                             f"right before a fenced block, but line {i + 1} is text")
        i += 1
    if pending:
        raise ValueError(f"{document}:{pending_line}: a readme-test marker at the end of the "
                         f"document")
    return blocks


def split_commands(body: list) -> list:
    joined, current = [], None
    for line in body:                       # `\` continues a command on the next line
        if current is not None:
            current += "\n" + line
        else:
            current = line
        if not current.endswith("\\"):
            joined.append(current)
            current = None
    if current is not None:
        joined.append(current)
    if any(line.startswith("$ ") for line in joined):           # a transcript
        commands = []
        for line in joined:
            if line.startswith("$ "):
                commands.append(Command(line[2:]))
            elif commands and line.strip():
                commands[-1].shown.append(line)
        return commands
    return [Command(line) for line in joined
            if line.strip() and not line.lstrip().startswith("#")]


def shown_pattern(line: str) -> re.Pattern:
    pattern = re.escape(line.strip())
    for varying, replacement in VARYING:
        pattern = varying.sub(replacement, pattern)
    return re.compile(r"\s*" + pattern + r"\s*")


def check_shown(command: Command, output: str) -> None:
    """Every shown line appears in the output, in order."""
    actual = output.splitlines()
    at = 0
    for line in command.shown:
        if line.strip() in ("", "..."):
            continue
        pattern = shown_pattern(line)
        for k in range(at, len(actual)):
            if pattern.fullmatch(actual[k]):
                at = k + 1
                break
        else:
            raise AssertionError(f"`{command.text}`: the document shows\n    {line}\nbut the "
                                 f"output (from line {at + 1} on) has no such line:\n"
                                 + "\n".join(f"    {a}" for a in actual[-60:]))


# ---------------------------------------------------------------------------------------
# running a document
# ---------------------------------------------------------------------------------------

class DocumentRun:
    """One document's working directory, environment, variables, ports, broker and
    background processes."""

    def __init__(self, document: str, workdir: Path):
        self.document = document
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        for entry in sorted(REPO.iterdir()):
            if entry.name.startswith(".") or entry.name in ("runs", "build", "dist"):
                continue
            (workdir / entry.name).symlink_to(entry)
        bindir = os.path.dirname(sys.executable)
        if not os.access(os.path.join(bindir, "edgefl"), os.X_OK):
            # no console script beside this interpreter (pytest run from elsewhere): the
            # same entry point through -m
            bindir = str(workdir.parent / f"{workdir.name}-bin")
            os.makedirs(bindir, exist_ok=True)
            shim = os.path.join(bindir, "edgefl")
            with open(shim, "w") as f:
                f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m edgefl.cli "$@"\n')
            os.chmod(shim, 0o755)
        self.env = {**os.environ, "PATH": bindir + os.pathsep + os.path.dirname(sys.executable)
                    + os.pathsep + os.environ.get("PATH", ""),
                    "COLUMNS": "100"}
        self.assignments: list[str] = []
        self.ports: dict[str, int] = {}
        self.broker = None
        self.background: list[tuple[str, subprocess.Popen, Path]] = []
        self.cleanups: list[str] = []

    def substitute(self, text: str, subs: list) -> str:
        for old, new in subs:
            if old in text:
                text = text.replace(old, self.expand(new))
        return text

    def expand(self, new: str) -> str:
        def port(match):
            return str(self.ports.setdefault(match.group(1), free_port()))
        new = re.sub(r"\{port:([\w-]+)\}", port, new)
        if re.search(r"\{broker_(url|host|port)\}", new):
            broker = self.start_broker()
            new = (new.replace("{broker_url}", broker.url)
                   .replace("{broker_host}", "127.0.0.1")
                   .replace("{broker_port}", str(broker.port)))
        return new

    def start_broker(self):
        if self.broker is None:
            if find_mosquitto() is None:
                pytest.skip("the block needs a broker and mosquitto is not installed")
            from brokers import MosquittoProcess

            directory = self.workdir.parent / f"{self.workdir.name}-broker"
            directory.mkdir(exist_ok=True)
            self.broker = MosquittoProcess(directory)
            self.broker.start()
        return self.broker

    def script(self, command: str) -> str:
        return "\n".join(self.assignments + [command])

    def run(self, block: Block, command: Command) -> None:
        if SYSTEM_CHANGING.match(command.text):
            raise AssertionError(f"{block.id}: `{command.text}` would change this machine "
                                 f"(packages, root); mark the block `skip REASON` or "
                                 f"`needs-root`")
        text = self.substitute(command.text, block.subs)
        shown = [self.substitute(line, block.subs) for line in command.shown]
        timeout = float(block.directive("timeout") or DEFAULT_TIMEOUT)
        if block.directive("background") is not None:
            self.start_background(block, text)
            return
        try:
            done = subprocess.run(["bash", "-o", "pipefail", "-c", self.script(text)],
                                  cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{block.id}: `{text}` did not finish within {timeout:g} s; "
                                 f"output so far:\n{(exc.output or b'').decode()[-3000:]}") \
                from None
        output = done.stdout.decode("utf-8", "replace")
        must_fail = any(s and s in command.text for s in block.all("fails"))
        if must_fail and done.returncode == 0:
            raise AssertionError(f"{block.id}: `{text}` should fail (marker `fails`) but "
                                 f"exited 0:\n{output[-3000:]}")
        if not must_fail and done.returncode != 0:
            raise AssertionError(f"{block.id}: `{text}` exited {done.returncode}:\n"
                                 f"{output[-3000:]}")
        if block.directive("output") != "any":
            check_shown(Command(text, shown), output)
        if re.fullmatch(r"[A-Za-z_]\w*=\S.*", command.text.strip()):   # C="edgefl ctl ..."
            self.assignments.append(text)

    def start_background(self, block: Block, text: str) -> None:
        log = self.workdir.parent / f"{self.workdir.name}-bg{len(self.background)}.log"
        with open(log, "wb") as out:
            # Ctrl-C as at a terminal: a test run started in the background (`cmd &` in a
            # script) passes SIGINT on ignored, and a shell cannot undo that with `trap`
            proc = subprocess.Popen(["bash", "-c", self.script(text)],
                                    cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_default_sigint)
        self.background.append((text, proc, log))
        ready = block.directive("ready")
        deadline = time.monotonic() + 30
        while ready and ready not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{block.id}: background `{text}` never printed "
                                     f"{ready!r} (exit status {proc.poll()}):\n"
                                     f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        if not ready:                    # a command that fails at once fails its block
            try:
                proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is not None:
            raise AssertionError(f"{block.id}: background `{text}` ended at once "
                                 f"({proc.returncode}):\n{log.read_text(errors='replace')}")

    def finish(self) -> list[str]:
        """Run the cleanups, stop the background processes as a user would (Ctrl-C); the
        problems found."""
        for command in reversed(self.cleanups):
            try:
                subprocess.run(["bash", "-c", self.script(command)], cwd=self.workdir,
                               env=self.env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=DEFAULT_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        self.cleanups = []
        problems = []
        for text, proc, log in self.background:
            if proc.poll() is not None:
                problems.append(f"background `{text}` had ended by the end of the document "
                                f"(status {proc.returncode}):\n"
                                f"{log.read_text(errors='replace')[-2000:]}")
                continue
            os.killpg(proc.pid, signal.SIGINT)
            try:
                status = proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
                problems.append(f"background `{text}` did not stop within 15 s of Ctrl-C")
                continue
            if status not in (0, 130, -signal.SIGINT):
                problems.append(f"background `{text}` exited {status} on Ctrl-C:\n"
                                f"{log.read_text(errors='replace')[-2000:]}")
        self.background = []
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        return problems


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _collect():
    items = []
    for document in DOCUMENTS:
        for block in parse_document(document):
            if block.language in RUNNABLE or block.directive("run") is not None:
                items.append(pytest.param(block, id=block.id))
        items.append(pytest.param(document, id=f"{document}:end"))
    return items


ITEMS = _collect()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    state: dict[str, DocumentRun] = {}

    def get(document: str) -> DocumentRun:
        if document not in state:
            state[document] = DocumentRun(document, tmp_path_factory.mktemp(
                "readme-" + re.sub(r"\W", "-", document)))
        return state[document]

    yield get
    for run in state.values():
        run.finish()


@pytest.mark.parametrize("item", ITEMS)
def test_block(item, runs):
    if isinstance(item, str):                  # the document's end: its background processes
        problems = runs(item).finish()
        assert not problems, "\n".join(problems)
        return
    block = item
    if os.environ.get("EDGEFL_BACKEND") == "numpy":
        pytest.skip("the documents are checked on the compiled core; CI's second pass on the "
                    "NumPy backend would repeat them several times slower")
    for name, reason in SKIPS.items():
        if block.directive(name) is not None:
            pytest.skip(f"{block.id}: {reason}" + (f" ({block.directive(name)})"
                                                    if block.directive(name) else ""))
    if block.directive("skip") is not None:
        pytest.skip(f"{block.id}: {block.directive('skip') or 'marked skip'}")
    run = runs(block.document)
    run.cleanups += [run.substitute(c, block.subs) for c in block.all("cleanup")]
    for command in block.commands:
        run.run(block, command)


# ---------------------------------------------------------------------------------------
# the parser itself: markers that are wrong are errors, not silently ignored
# ---------------------------------------------------------------------------------------

def _parse(tmp_path, monkeypatch, text):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "doc.md").write_text(text)
    return parse_document("doc.md")


def test_markers_transcripts_and_substitutions_are_parsed(tmp_path, monkeypatch):
    blocks = _parse(tmp_path, monkeypatch, (
        "<!-- readme-test: sub --port 1883 => --port {port:b} -->\n"
        "text\n\n<!-- readme-test: background; ready listening -->\n\n"
        "```sh\nedgefl broker --port 1883   # until Ctrl-C\n```\n"
        "```console\n$ edgefl info\nedgefl   0.1.0\n...\n$ a \\\n  b\nout\n```\n"
        "```\nnot run\n```\n"))
    assert [b.language for b in blocks] == ["sh", "console", ""]
    assert blocks[0].directives == [("background", ""), ("ready", "listening")]
    assert blocks[0].subs == [("--port 1883", "--port {port:b}")]
    assert [c.text for c in blocks[0].commands] == ["edgefl broker --port 1883   # until Ctrl-C"]
    assert [(c.text, c.shown) for c in blocks[1].commands] == [
        ("edgefl info", ["edgefl   0.1.0", "..."]), ("a \\\n  b", ["out"])]


@pytest.mark.parametrize("text, message", [
    ("<!-- readme-test: skipp typo -->\n```sh\nx\n```\n", "unknown readme-test directive"),
    ("<!-- readme-test: skip why -->\nprose\n```sh\nx\n```\n", "must come right before"),
    ("text\n<!-- readme-test: run -->\n", "at the end of the document"),
    ("<!-- readme-test: sub nothing -->\n", "sub needs 'OLD => NEW'"),
])
def test_a_wrong_marker_is_an_error(tmp_path, monkeypatch, text, message):
    with pytest.raises(ValueError, match=message):
        _parse(tmp_path, monkeypatch, text)


@pytest.mark.parametrize("shown, output, ok", [
    ("fedavg: final accuracy 0.9471 (best 0.9499 at round 16), 20 rounds in 0.06 s; outputs "
     "in runs/quickstart-20261126-133257",
     "x\nfedavg: final accuracy 0.9471 (best 0.9499 at round 16), 20 rounds in 0.41 s; "
     "outputs in runs/quickstart-20261201-090000-2\n", True),
    ("fedavg: final accuracy 0.9471", "fedavg: final accuracy 0.9472\n", False),
    ("run ... state queued", "run long-2: state queued\n", True),
    ("07:57:46 digits-2 run_started: round 1", "08:01:02 digits-2 run_started: round 1\n", True),
    ("07:57:46 digits-2 run_started: round 1", "08:01:02 digits-3 run_started: round 1\n", False),
])
def test_shown_output_is_compared_line_by_line(shown, output, ok):
    if ok:
        check_shown(Command("c", [shown]), output)
    else:
        with pytest.raises(AssertionError, match="the document shows"):
            check_shown(Command("c", [shown]), output)


def test_shown_lines_must_come_in_order():
    check_shown(Command("c", ["a", "...", "c"]), "a\nb\nc\n")
    with pytest.raises(AssertionError):
        check_shown(Command("c", ["c", "a"]), "a\nb\nc\n")


def test_commands_see_earlier_assignments_and_fail_loudly(tmp_path):
    run = DocumentRun("doc.md", tmp_path / "w")
    block = Block("doc.md", 1, "console", [], [], [])
    run.run(block, Command('C="echo hello"'))
    run.run(block, Command("$C world", ["hello world"]))
    with pytest.raises(AssertionError, match="exited 3"):
        run.run(block, Command("exit 3"))
    with pytest.raises(AssertionError, match="would change this machine"):
        run.run(block, Command("pip install -e '.[dev]'"))     # never run unmarked
    failing = Block("doc.md", 1, "console", [("fails", "false")], [], [])
    run.run(failing, Command("false"))
    with pytest.raises(AssertionError, match="should fail"):
        run.run(failing, Command("true && echo false"))


def test_background_blocks_run_until_the_end_and_stop_on_ctrl_c(tmp_path):
    run = DocumentRun("doc.md", tmp_path / "w")
    block = Block("doc.md", 1, "sh", [("background", ""), ("ready", "listening on")],
                  [("1883", "{port:b}")], [])
    run.run(block, Command("echo listening on 1883; exec sleep 60"))
    (text, proc, log), = run.background
    assert text == f"echo listening on {run.ports['b']}; exec sleep 60" and run.ports["b"] != 1883
    assert proc.poll() is None                      # still running after its block
    assert run.finish() == [] and proc.returncode == -signal.SIGINT
    # a background command that has died by the end of the document is a failure
    quick = Block("doc.md", 2, "sh", [("background", "")], [], [])
    with pytest.raises(AssertionError, match="ended at once"):
        run.run(quick, Command("exit 4"))
    problems = run.finish()
    assert len(problems) == 1 and "had ended by the end of the document (status 4)" in \
        problems[0]
    never = Block("doc.md", 3, "sh", [("background", ""), ("ready", "never said")], [], [])
    with pytest.raises(AssertionError, match="never printed 'never said'"):
        run.run(never, Command("echo something else"))
    run.finish()


def test_a_broker_placeholder_starts_a_fresh_broker(tmp_path):
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    from edgefl.transport.broker import probe

    run = DocumentRun("doc.md", tmp_path / "w")
    try:
        url = run.expand("{broker_url}")
        port = int(run.expand("{broker_port}"))
        assert url == f"mqtt://127.0.0.1:{port}" and port != 1883
        assert probe("127.0.0.1", port, timeout=2, any_answer=True)
    finally:
        run.finish()
    assert run.broker is None


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_repository_path_the_document_names_exists(document):
    """Links and `code` paths into the repository (docs/..., tools/..., edgefl/..., ...:
    a file name with an extension, or a directory with its slash; `edgefl/lab/ctl` is an
    MQTT topic) name files that are there; a file a command creates is in a shell block."""
    text = (REPO / document).read_text(encoding="utf-8")
    base = (REPO / document).parent
    named = {(base / m).resolve() for m in re.findall(r"\]\(([^)#\s:]+)", text)}
    named |= {(REPO / m).resolve() for m in re.findall(
        r"`((?:docs|tools|edgefl|tests|broker|devices|csrc)/[^`\s*<>]*(?:\.\w+|/))`", text)}
    missing = sorted(str(p.relative_to(REPO)) for p in named if not p.exists())
    assert not missing, f"{document} names paths that do not exist: {missing}"


def test_cleanups_run_at_the_end_of_the_document(tmp_path):
    run = DocumentRun("doc.md", tmp_path / "w")
    run.cleanups.append("touch cleaned")
    run.cleanups.append("exit 5")                  # best effort: a failing one is no problem
    assert run.finish() == [] and (tmp_path / "w" / "cleaned").exists()
