"""Run the benchmarks, and put every ratio they judge against a target in one table.

Usage::

    python bench/run_all.py [--only control_plane,s3_tier] [--results bench/results]
        [--args 's3_tier=--sizes 64 --repeats 1'] [--timeout 1800] [--write-readme] [--dry-run]
    python bench/run_all.py --from-json DIR [--only ...] [--results ...] [--write-readme] [--dry-run]

Each chosen script runs as ``python bench/<name>.py --json <results>/<name>.json [its --args]``,
one at a time (two at once would disturb each other's timings), from the repository root. Its
report (stdout) goes to ``<results>/<name>.txt``; its progress (stderr) is shown and kept in
``<results>/<name>.log``. Every script's JSON has a ``target_ratios`` member beside its own
(``bench.common.ratio_vs_target``): what is compared, the measured ratio, the target, met or not.
This collects one row per entry, in the scripts' order. A script that fails (a non-zero exit, a
timeout, no JSON, no ``target_ratios``, or none of its targets measured with the options given)
is one row saying why, and the others still run.

``--from-json DIR`` runs nothing and builds the table from ``DIR/<name>.json`` instead; without
``--only``, any other ``*.json`` there with a ``target_ratios`` member (e.g. ``gpu.json`` from
``bench/gpu_checkpoint.sh``) is added under its file name.

It writes the table as markdown (``<results>/table.md``) and JSON (``<results>/table.json``), prints
the markdown, and with ``--write-readme`` replaces what is between ``<!-- run_all table -->`` and
``<!-- /run_all table -->`` in ``bench/README.md``. ``--dry-run`` runs and writes nothing: it
prints the commands it would run, or with ``--from-json`` the table it would write.

Exit status: 0 when every script ran and reported its ratios, met or not (a benchmark measures, it
asserts nothing); 1 when a row says a script failed.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))  # bench.common, as bench/x.py too

from bench.common import exit_on_sigterm, progress, write_json  # noqa: E402

BENCHMARKS = (
    "control_plane",
    "policy_rollout",
    "memory_tier",
    "s3_tier",
    "checkpoint_path",
    "reshard",
    "scale",
)
README = BENCH / "README.md"
START_MARKER = "<!-- run_all table -->"
END_MARKER = "<!-- /run_all table -->"
TABLE_MD = "table.md"
TABLE_JSON = "table.json"
# After a timeout: SIGINT unwinds every script's `finally` (stop the servers and agents it
# started; control_plane.py has no SIGTERM handler), then this long before SIGKILL.
STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class Row:
    """One row of the table: a ratio a script judged against its target, or why there is none."""

    benchmark: str
    name: str  # what is compared; empty when the script failed
    value: float | None
    target: str | None
    met: bool | None  # None when nothing was measured
    error: str | None = None  # why the script has no ratios to report


@dataclass
class Result:
    """What one script's JSON said (or why it could not be read)."""

    benchmark: str
    json_path: Path
    rows: list[Row] = field(default_factory=list)
    cpu_count: int | None = None
    written: float | None = None  # the JSON file's mtime
    seconds: float | None = None  # how long the script ran (None with --from-json)

    @property
    def failed(self) -> bool:
        return any(r.error is not None for r in self.rows)

    def fail(self, error: str) -> Result:
        """This result as one row saying why the script has no ratios to report."""
        self.rows = [failure(self.benchmark, error)]
        return self


def label(benchmark: str) -> str:
    """The table's name for a benchmark: the script's file name, or an extra JSON file's."""
    return f"{benchmark}.py" if benchmark in BENCHMARKS else f"{benchmark}.json"


def failure(benchmark: str, error: str) -> Row:
    return Row(benchmark=benchmark, name="", value=None, target=None, met=None, error=error)


def shown(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it (it may end up in the README)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------- reading a script's JSON


def _entry(benchmark: str, entry: Any) -> Row | None:
    """A ``target_ratios`` entry as a row; None when it is not of the common form."""
    if not isinstance(entry, dict):
        return None
    name, value, target, met = (entry.get(k) for k in ("name", "value", "target", "met"))
    numeric = value is None or (isinstance(value, int | float) and not isinstance(value, bool))
    if not (isinstance(name, str) and numeric and isinstance(target, str) and isinstance(met, bool)):
        return None
    number = None if value is None else float(value)
    return Row(benchmark=benchmark, name=name, value=number, target=target, met=met)


def read_result(benchmark: str, path: Path) -> Result:
    """The rows of one script's JSON file; a single failure row when there is nothing to read."""
    result = Result(benchmark=benchmark, json_path=path)
    try:
        payload = json.loads(path.read_text())
        result.written = path.stat().st_mtime
    except FileNotFoundError:
        return result.fail(f"no {shown(path)}")
    except (OSError, ValueError) as exc:
        return result.fail(f"unreadable JSON in {shown(path)}: {exc}")
    entries = payload.get("target_ratios") if isinstance(payload, dict) else None
    if not isinstance(entries, list):
        return result.fail(f"no target_ratios list in {path.name} (written before run_all.py?)")
    if not entries:
        return result.fail("no ratio with a target was measured (do its options leave the target out?)")
    rows = [_entry(benchmark, e) for e in entries]
    if any(r is None for r in rows):
        return result.fail(f"a target_ratios entry in {path.name} is not name/value/target/met")
    result.rows = [r for r in rows if r is not None]
    config = payload.get("config")
    cpus = config.get("cpu_count") if isinstance(config, dict) else None
    result.cpu_count = cpus if isinstance(cpus, int) else None
    return result


def results_from_json(directory: Path, chosen: Sequence[str], only_given: bool) -> list[Result]:
    """``directory/<name>.json`` for each chosen benchmark, then (without ``--only``) any other JSON
    file there with a ``target_ratios`` member, by file name."""
    results = [read_result(name, directory / f"{name}.json") for name in chosen]
    if only_given:
        return results
    for path in sorted(directory.glob("*.json")):
        if path.stem in BENCHMARKS or path.name == TABLE_JSON:
            continue
        extra = read_result(path.stem, path)
        if not extra.failed:  # a JSON file of something else: not ours to report
            results.append(extra)
    return results


# ---------------------------------------------------------------------- running the scripts


def command(name: str, results: Path, extra: Sequence[str]) -> list[str]:
    return [sys.executable, str(BENCH / f"{name}.py"), "--json", str(results / f"{name}.json"), *extra]


def _tee(source: IO[bytes], log: IO[bytes]) -> None:
    """Copy the child's stderr, line by line, to the log file and to ours."""
    try:
        for line in iter(source.readline, b""):
            log.write(line)
            log.flush()
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
    except (OSError, ValueError):  # the log closed under us: a leftover grandchild kept the pipe
        pass


def _stop(proc: subprocess.Popen[bytes], *, signalled: bool) -> None:
    """Stop a script that still runs so that its ``finally`` stops the servers and agents it started:
    SIGINT unless it had one already (a Ctrl-C reaches its process group too), up to
    ``STOP_GRACE_S`` to exit, then SIGKILL."""
    if proc.poll() is not None:
        return
    if not signalled:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def last_line(path: Path) -> str:
    """The last non-blank line of a log (e.g. the exception that ended the script), shortened."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    text = lines[-1] if lines else ""
    return text if len(text) <= 200 else text[:197] + "..."


def run_script(name: str, results: Path, extra: Sequence[str], timeout_s: float) -> Result:
    """Run one benchmark script into ``results`` and read the JSON it wrote."""
    json_path = results / f"{name}.json"
    json_path.unlink(missing_ok=True)  # a failed run must not report the previous run's ratios
    cmd = command(name, results, extra)
    log_path = results / f"{name}.log"
    progress(f"run_all: {shlex.join(cmd)}")
    started = time.monotonic()
    error: str | None = None
    returncode: int | None = None
    with (results / f"{name}.txt").open("wb") as report, log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=report, stderr=subprocess.PIPE
        )
        assert proc.stderr is not None
        tee = threading.Thread(target=_tee, args=(proc.stderr, log), daemon=True)
        tee.start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s:g} s"
            _stop(proc, signalled=False)
        except KeyboardInterrupt:
            _stop(proc, signalled=True)
            raise
        except BaseException:  # SIGTERM (exit_on_sigterm) or anything else: the script stops too
            _stop(proc, signalled=False)
            raise
        finally:
            tee.join(timeout=10)
    seconds = time.monotonic() - started
    if error is None and returncode != 0:
        error = f"exit {returncode}: {last_line(log_path) or 'no output on stderr'}"
    if error is not None:
        progress(f"run_all: {name} failed after {seconds:.0f} s: {error}")
        result = Result(benchmark=name, json_path=json_path).fail(error)
    else:
        result = read_result(name, json_path)
        problem = next((r.error for r in result.rows if r.error is not None), None)
        progress(
            f"run_all: {name} done in {seconds:.0f} s" + ("" if problem is None else f", but: {problem}")
        )
    result.seconds = round(seconds, 1)
    return result


# ---------------------------------------------------------------------- the table


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown_row(row: Row) -> str:
    if row.error is not None:
        cells = [f"`{label(row.benchmark)}`", f"**failed**: {_cell(row.error)}", "-", "-", "-"]
    else:
        value = "-" if row.value is None or not math.isfinite(row.value) else f"{row.value:.2f}x"
        met = "met" if row.met else "**not met**"
        cells = [f"`{label(row.benchmark)}`", _cell(row.name), value, _cell(row.target or "-"), met]
    return "| " + " | ".join(cells) + " |"


def caption(results: Sequence[Result]) -> str:
    """When and on how many CPUs the ratios were measured (as far as the JSON files say)."""
    written = [r.written for r in results if r.written is not None]
    when = "nothing measured"
    if written:
        when = datetime.fromtimestamp(max(written), UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpus = sorted({r.cpu_count for r in results if r.cpu_count is not None})
    where = ""
    if cpus:
        counts = str(cpus[0]) if len(cpus) == 1 else f"{cpus[0]}-{cpus[-1]}"
        where = f", {counts} CPU{'' if cpus == [1] else 's'}"
    return (
        f"Ratios from `bench/run_all.py` ({when}{where}), each against a baseline of the same run;\n"
        "the sections below say what each script compares."
    )


def markdown(results: Sequence[Result]) -> str:
    lines = [
        caption(results),
        "",
        "| benchmark | compared | ratio | target | met |",
        "|---|---|---|---|---|",
        *(markdown_row(row) for result in results for row in result.rows),
    ]
    return "\n".join(lines) + "\n"


def table_json(results: Sequence[Result]) -> dict[str, Any]:
    return {
        "rows": [asdict(row) for result in results for row in result.rows],
        "scripts": [
            {
                "benchmark": r.benchmark,
                "json": shown(r.json_path),
                "seconds": r.seconds,
                "failed": r.failed,
                "cpu_count": r.cpu_count,
            }
            for r in results
        ],
    }


def replace_table(text: str, table_md: str) -> str:
    """``text`` (the README) with what is between the markers replaced by ``table_md``."""
    start = text.find(START_MARKER)
    end = text.find(END_MARKER)
    if start < 0 or end < start or text.count(START_MARKER) != 1 or text.count(END_MARKER) != 1:
        raise ValueError(f"{README} must hold {START_MARKER} once, then {END_MARKER} once")
    return f"{text[: start + len(START_MARKER)]}\n\n{table_md.strip()}\n\n{text[end:]}"


# ---------------------------------------------------------------------- main


def _script_args(
    parser: argparse.ArgumentParser, given: Sequence[str], chosen: Sequence[str]
) -> dict[str, list[str]]:
    """``--args NAME=OPTIONS`` (repeatable) as {name: argv}."""
    found: dict[str, list[str]] = {}
    for item in given:
        name, sep, options = item.partition("=")
        if not sep or name not in chosen:
            parser.error(f"--args must be NAME=OPTIONS with NAME one of {','.join(chosen)}, got {item!r}")
        argv = shlex.split(options)
        if "--json" in argv or any(a.startswith("--json=") for a in argv):
            parser.error(f"--args {name}: run_all.py gives the script its --json itself")
        found.setdefault(name, []).extend(argv)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", help=f"comma-separated benchmarks to run (default all: {','.join(BENCHMARKS)})"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=BENCH / "results",
        help="where the scripts' JSON and reports and the table go (default bench/results)",
    )
    parser.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="more options for one script, e.g. 's3_tier=--sizes 64 --repeats 1' (repeatable)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one script may run (default 1800)"
    )
    parser.add_argument("--from-json", type=Path, metavar="DIR", help="run nothing: read DIR/<name>.json")
    parser.add_argument(
        "--write-readme", action="store_true", help="replace the table between the markers in bench/README.md"
    )
    parser.add_argument("--dry-run", action="store_true", help="run and write nothing; say what it would do")
    args = parser.parse_args(argv)
    chosen = list(BENCHMARKS)
    if args.only is not None:
        wanted = {name.strip().removesuffix(".py") for name in args.only.split(",") if name.strip()}
        unknown = wanted - set(BENCHMARKS)
        if not wanted or unknown:
            parser.error(f"--only must name some of {','.join(BENCHMARKS)}; unknown: {sorted(unknown)}")
        chosen = [name for name in BENCHMARKS if name in wanted]
    extra = _script_args(parser, args.args, chosen)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.from_json is not None and (extra or not args.from_json.is_dir()):
        parser.error("--from-json needs an existing directory, and runs nothing to give --args to")
    if args.write_readme:
        try:
            replace_table(README.read_text(), "")
        except (OSError, ValueError) as exc:
            parser.error(f"--write-readme: {exc}")

    if args.dry_run and args.from_json is None:
        for name in chosen:
            print(shlex.join(command(name, args.results, extra.get(name, []))))
        outputs = [str(args.results / TABLE_MD), str(args.results / TABLE_JSON)]
        print("would write:", ", ".join(outputs + ([f"{README} (the table)"] if args.write_readme else [])))
        return 0

    if args.from_json is not None:
        results = results_from_json(args.from_json, chosen, only_given=args.only is not None)
    else:
        exit_on_sigterm()  # unwinds like Ctrl-C: the running script is stopped, not orphaned
        # Started in the background by a shell without job control, we ignore SIGINT, and so would
        # the scripts (an ignored signal stays ignored across exec): SIGINT could not stop them.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        args.results.mkdir(parents=True, exist_ok=True)
        try:
            results = [run_script(name, args.results, extra.get(name, []), args.timeout) for name in chosen]
        except KeyboardInterrupt:
            progress("run_all: interrupted; no table written")
            return 130

    table_md = markdown(results)
    print(table_md, end="")
    if args.dry_run:
        return 1 if any(r.failed for r in results) else 0
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / TABLE_MD).write_text(table_md)
    write_json(args.results / TABLE_JSON, table_json(results))
    progress(f"run_all: wrote {args.results / TABLE_MD} and {args.results / TABLE_JSON}")
    if args.write_readme:
        README.write_text(replace_table(README.read_text(), table_md))
        progress(f"run_all: replaced the table in {README}")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
