"""The README's command lines work as written: CI installs and tests exactly as the README says, and
every command block marked ``<!-- runs offline -->`` runs against the shipped pair."""

import pathlib
import re
import shlex
import subprocess
import sys

from versions import newest_transformers_only

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
CI = (REPO / ".ci" / "run").read_text()


def _bash_blocks(text: str) -> list:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)


def _commands(block: str) -> list:
    """The command lines of a bash block: continuations joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def _ci_value(name: str) -> str:
    return re.search(rf"^{name}='([^']*)'$", CI, flags=re.MULTILINE).group(1)


def test_ci_installs_the_readme_extras_and_runs_the_readme_test_command():
    install = README[README.index("## Install"):README.index("## A real pair")]
    cpu = _commands(_bash_blocks(install)[0])
    assert cpu[0] == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert "pip install -e ." in cpu and "python demo.py" in cpu  # the demo needs no extra
    tests = _commands(_bash_blocks(README[README.index("## Run the tests"):README.index("## Documentation")])[0])
    assert tests == [f'pip install -e "{_ci_value("EXTRAS")}"', _ci_value("TEST_COMMAND")]
    assert '/bin/pip" install -q --disable-pip-version-check -e "$EXTRAS"' in CI and '&& $TEST_COMMAND "$@")' in CI
    assert re.search(r"^for tf in \$FULL_LANES; do\n  lane \"\$tf\"\ndone$", CI, flags=re.MULTILINE)  # the whole suite


def _offline_blocks() -> list:
    return re.findall(r"<!-- runs offline -->\n```bash\n(.*?)```", README + DOCS, flags=re.DOTALL)


@newest_transformers_only
def test_offline_readme_commands_run_against_the_shipped_pair(tmp_path):
    """In a scratch folder that links the repository's files (outputs land there, the clone stays
    clean), each command as written, in README order: one run, no traceback."""
    for entry in REPO.iterdir():
        if entry.name not in (".git", "runs") and not entry.name.startswith(".venv"):
            (tmp_path / entry.name).symlink_to(entry)
    commands = [c for block in _offline_blocks() for c in _commands(block)]
    assert len(commands) >= 3 and any("push_to_hub" in c and "--dry-run" in c for c in commands)
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "python", command
        proc = subprocess.run([sys.executable] + argv[1:], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (command, proc.stdout[-2000:], proc.stderr[-3000:])
    card = (tmp_path / "runs" / "pair-drafter-card.md").read_text()
    assert "base_model: your-org/pair-target" in card and "vllm serve your-org/pair-target" in card


def test_no_file_names_a_path_of_the_machine_it_was_written_on():
    """Docs and code reference only files in the repository: no absolute machine paths, no notes file
    that is not shipped (the kind of reference a new user cannot follow)."""
    # Built from pieces so that this line does not itself read as a machine path to repository scanners.
    machine_roots = ["/" + "work/", "shared" + "/docs", "/" + r"home/\w+/", "/" + r"Users/\w+/", "/" + r"root/\."]
    forbidden = re.compile("|".join(machine_roots))
    found = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if path.suffix not in (".py", ".md", ".toml", ".json", ".txt", "") or not path.is_file():
            continue
        if parts[0] in (".git", "runs") or parts[0].startswith(".venv") or "__pycache__" in parts:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if forbidden.search(line) and path.name != "test_readme_commands.py":
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
