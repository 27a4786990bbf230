"""The README's examples run as written: every ```python block is executed, every complete `dsv41 ...` command in a
```bash block parses with the real command line, and `.ci/run` runs the README's test command."""

import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks(lang: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(rf"```{lang}\n(.*?)```", f.read(), flags=re.S)


def _commands() -> list[str]:
    """Complete `dsv41 ...` commands of the bash blocks (continuations joined, comments dropped, `...` skipped)."""
    out = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                cmd = part.split(" #")[0].strip()
                if cmd.startswith("dsv41 ") and "..." not in cmd:
                    out.append(cmd)
    return out


def test_readme_has_the_examples_this_test_checks():
    assert len(_blocks("python")) >= 2
    commands = _commands()
    assert any(c.startswith("dsv41 generate") for c in commands)
    assert any("--init-from default" in c for c in commands)


@pytest.mark.parametrize("command", _commands())
def test_readme_commands_parse(command):
    from dsv41_jax.cli import build_parser

    args = build_parser().parse_args(shlex.split(command)[1:])
    assert callable(args.fn)


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        test_line = next(line for line in f if line.rstrip().endswith("# the test suite"))
    command = test_line.split("#")[0].strip()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    for part in command.split("&&"):
        assert part.strip() in ci, f"`.ci/run` does not run the README's `{part.strip()}`"


@pytest.mark.slow  # compiles the tiny forward and the default model's engine
@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_readme_python_block_runs(index):
    code = _blocks("python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": f"readme_block_{index}"})
