"""The docker files, the Makefile's docker targets and the CI script agree with each other.

Nothing here runs docker: the files are parsed, so a renamed build argument, a moved wheels
folder or a dropped target fails in the ordinary suite instead of in the slow container leg.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cuda"]
DOCKER_TARGETS = ["docker-build", "docker-test", "docker-verify", "docker-ci"]


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    pairs = (ln.strip().split(None, 1) for ln in joined.splitlines() if ln.strip())
    return [(p[0].upper(), p[1] if len(p) > 1 else "") for p in pairs]


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """Build arguments and their defaults ("" when declared without one)."""
    declared = (rest.split("=", 1) for kw, rest in instructions if kw == "ARG")
    return {d[0]: (d[1] if len(d) > 1 else "") for d in declared}


def _env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    pairs = (
        m.groups()
        for kw, rest in instructions
        if kw == "ENV"
        for m in re.finditer(r"(\w+)=(\S+)", rest)
    )
    return dict(pairs)


def _make_defaults(makefile: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+) \?= ?(.*)$", makefile, flags=re.M))


def _recipe(makefile: str, target: str) -> str:
    """The recipe of `target`, continuation lines joined."""
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n?)*)", makefile, flags=re.M)
    assert match, f"Makefile has no target {target!r}"
    return re.sub(r"\\\n\s*", " ", match.group(1))


@pytest.fixture(scope="module")
def makefile() -> str:
    return (ROOT / "Makefile").read_text()


@pytest.fixture(params=DOCKERFILES, ids=lambda p: Path(p).name)
def dockerfile(request) -> list[tuple[str, str]]:
    return _instructions(ROOT / request.param)


@pytest.fixture(scope="module")
def cpu_dockerfile() -> list[tuple[str, str]]:
    return _instructions(ROOT / "docker/Dockerfile")


def test_every_stage_builds_on_the_base_image_argument(dockerfile):
    first_from = next(i for i, (kw, _) in enumerate(dockerfile) if kw == "FROM")
    assert "BASE_IMAGE" in _args(dockerfile[:first_from])
    stages = [rest for kw, rest in dockerfile if kw == "FROM"]
    assert stages and all(rest.startswith("${BASE_IMAGE}") for rest in stages)


def test_base_image_has_a_default(dockerfile):
    assert _args(dockerfile)["BASE_IMAGE"]


def test_wheels_folder_is_what_pip_is_pointed_at(dockerfile):
    copies = [rest.split() for kw, rest in dockerfile if kw == "COPY"]
    wheel_dests = [c[-1].rstrip("/") for c in copies if c[0].rstrip("/") == "docker/wheels"]
    assert wheel_dests == [_env(dockerfile)["PIP_FIND_LINKS"]]


def test_default_command_runs_the_suite(dockerfile):
    assert [rest for kw, rest in dockerfile if kw == "CMD"] == ['["make", "test"]']


def test_image_venv_carries_the_makefile_stamp(dockerfile, makefile):
    """`make test` in the container must find the venv installed, not rebuild it."""
    assert _make_defaults(makefile)["VENV"] == ".venv"
    assert "$(VENV)/.installed" in makefile
    venv = _env(dockerfile)["VENV"]
    runs = " ".join(rest for kw, rest in dockerfile if kw == "RUN")
    assert "make install" in runs or '"$VENV/.installed"' in runs
    assert _env(dockerfile)["PATH"].startswith(f"{venv}/bin:")


def test_cpu_image_pins_the_makefile_torch(cpu_dockerfile, makefile):
    assert _args(cpu_dockerfile)["TORCH_SPEC"] == _make_defaults(makefile)["TORCH_SPEC"]


def test_torch_is_installed_before_the_project(cpu_dockerfile):
    runs = [rest for kw, rest in cpu_dockerfile if kw == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if '"$TORCH_SPEC"' in r)
    project_step = next(i for i, r in enumerate(runs) if "make install" in r)
    assert torch_step < project_step


@pytest.mark.parametrize("target", DOCKER_TARGETS)
def test_makefile_has_docker_target(makefile, target):
    assert _recipe(makefile, target).strip()
    assert re.search(rf"^\.PHONY:.*\b{target}\b", makefile, flags=re.M)


def test_build_args_are_declared_by_the_cpu_dockerfile(makefile, cpu_dockerfile):
    build = _recipe(makefile, "docker-build")
    passed = set(re.findall(r"--build-arg (\w+)=", build))
    assert passed == {"BASE_IMAGE", "TORCH_SPEC"}
    assert passed <= set(_args(cpu_dockerfile))
    assert _make_defaults(makefile)["DOCKERFILE"] == "docker/Dockerfile"


@pytest.mark.parametrize("target", ["docker-test", "docker-verify"])
def test_container_runs_get_shared_memory_and_are_removed(makefile, target):
    assert "$(DOCKER_RUN)" in _recipe(makefile, target)
    line = re.search(r"^DOCKER_RUN := (.*)$", makefile, flags=re.M).group(1)
    assert "--rm" in line
    shm = _make_defaults(makefile)["DOCKER_SHM"]
    assert "--ipc=host" in line or ("--shm-size=$(DOCKER_SHM)" in line and shm)


def test_wheels_folder_is_kept_but_its_wheels_are_not():
    assert (ROOT / "docker/wheels/README.md").is_file()
    assert "/docker/wheels/*.whl" in (ROOT / ".gitignore").read_text().splitlines()
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert not any(line.strip().startswith("docker") for line in ignored)


def test_ci_script_uses_the_distribution_client_and_the_marker(pytestconfig):
    script = (ROOT / "docker/ci-local-base.sh").read_text()
    assert re.search(r"^DOCKER=/usr/bin/docker$", script, flags=re.M)
    assert "-m multirank" in script
    markers = [m.split(":", 1)[0].strip() for m in pytestconfig.getini("markers")]
    assert "multirank" in markers


def test_ci_runs_the_docker_leg():
    assert "make docker-ci" in (ROOT / ".ci/run").read_text()


def test_ci_builds_the_image_beside_the_host_jobs_and_tests_in_it_after_them():
    script = (ROOT / ".ci/run").read_text()
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if "setsid make docker-ci" in line)
    soak = next(i for i, line in enumerate(lines) if line.startswith('phase "make soak"'))
    result = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("phase") and "docker_leg_result" in line
    )
    assert "HOST_DONE=" in lines[start] and "HOST_PID=$$" in lines[start]
    assert start < soak < result
    assert "trap stop_docker_leg EXIT" in script


def _wait_for_host(tmp_path, env: dict) -> subprocess.CompletedProcess:
    """docker/ci-local-base.sh's `wait_for_host`, run alone."""
    script = (ROOT / "docker/ci-local-base.sh").read_text()
    body = re.search(r"^wait_for_host\(\) \{.*?^\}", script, flags=re.M | re.S)
    assert body
    program = 'log() { echo "docker-ci: $*"; }\n' + body.group(0) + "\nwait_for_host\n"
    return subprocess.run(
        ["bash", "-c", program],
        env={**os.environ, "WAIT_TIMEOUT": "4", "HOST_DONE": str(tmp_path / "done"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_container_leg_waits_for_the_host_and_ends_if_it_is_gone(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = _wait_for_host(tmp_path, {"HOST_PID": str(dead.pid)})
    assert gone.returncode == 1 and f"(pid {dead.pid}) is gone" in gone.stdout
    late = _wait_for_host(tmp_path, {"HOST_PID": str(os.getpid())})
    assert late.returncode == 1 and "WAIT_TIMEOUT=4" in late.stdout
    (tmp_path / "done").touch()
    ready = _wait_for_host(tmp_path, {"HOST_PID": str(os.getpid())})
    assert ready.returncode == 0, ready.stdout + ready.stderr


class _Items:
    """A plugin that keeps the node ids a collection ends with (after deselection)."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.ids = [item.nodeid for item in session.items]


def _collected(env_value: str | None, *args: str) -> list[str]:
    """The tests a collection of `args` keeps, run in this process (a subprocess would
    import torch and the suite again, three times over)."""
    items = _Items()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        mp.delenv("CPBT_CONTAINER_TESTS", raising=False)
        if env_value is not None:
            mp.setenv("CPBT_CONTAINER_TESTS", env_value)
        code = pytest.main(["-q", "--collect-only", "-p", "no:xdist", "-p", "no:cacheprovider",
                            *args], plugins=[items])  # fmt: skip
    assert code == 0
    return items.ids


@pytest.mark.long
def test_the_host_leaves_exactly_the_container_legs_tests_to_it():
    """With .ci/run's list, the host collects everything but the multi-rank tests of the
    listed paths, which are exactly what the container leg selects (`-m multirank`)."""
    script = (ROOT / ".ci/run").read_text()
    listed = re.search(r'^CONTAINER_TESTS="([^"]*)"', script, flags=re.M)
    assert listed and '"-m multirank $CONTAINER_TESTS"' in script
    assert 'CPBT_CONTAINER_TESTS="$CONTAINER_TESTS" make test' in script
    paths = listed.group(1).replace("\\\n", " ").split()
    assert len(paths) == 5 and all((ROOT / p).exists() for p in paths)
    mixed = ["tests/harness/test_harness_torchrun.py", "tests/drills/test_drills_faults.py"]
    ordered = _collected(None, *mixed, "tests/harness/test_soak.py", __file__)
    everything = set(ordered)
    on_host = set(_collected(" ".join(paths), *mixed, "tests/harness/test_soak.py", __file__))
    in_container = set(_collected(None, "-m", "multirank", *mixed))
    assert in_container and on_host == everything - in_container
    # `long` tests come first (tests/conftest.py), this one among them, from the last file
    assert ordered[0].endswith("::test_the_host_leaves_exactly_the_container_legs_tests_to_it")
    assert any("test_drills_faults.py" in t for t in on_host)  # its single-rank tests stay
    soak = {t for t in everything if "test_soak.py" in t}
    assert soak and soak <= on_host  # multi-rank tests of an unlisted file stay on the host
