"""The README's example runs as written, and its plan printout is what the code prints."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_example_runs_and_prints_its_plan():
    example = _blocks("python")[0]
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    printed = str(
        namespace["step"].plan(namespace["model"], namespace["opt_state"], namespace["x"])
    )
    shown = re.search(r"```\n(Plan \(strategy.*?)```", README.read_text(), flags=re.DOTALL)
    assert shown is not None, "README shows no plan printout"
    assert printed.strip() == shown.group(1).strip()


def test_readme_audit_table_is_what_the_audit_prints():
    import offload_eqx as ox

    example = _blocks("python")[0]
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    report = ox.audit(namespace["step"], namespace["model"], namespace["opt_state"], namespace["x"])
    printed = "\n".join(line.rstrip() for line in report.table().splitlines())
    shown = re.search(r"```\n(Transfers per call.*?)```", README.read_text(), flags=re.DOTALL)
    assert shown is not None, "README shows no audit report"
    assert printed.strip() == shown.group(1).strip()
