"""The documentation site: its generated pages match the code, it builds with warnings as errors, the
reference lists every config field, strategy option, CLI flag, environment variable and run-directory key
the code has, the user-facing pages carry no dated run history, and (where chromium is installed) the
built site opens in a headless browser with its navigation and search working."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_cli

DOCS = ROOT / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _load("gen_docs")


def _table_keys(page: str, heading: str | None = None) -> set[str]:
    """The first-column keys (`key`) of the tables of a reference page, or of one ``## heading`` of it."""
    text = (DOCS / "reference" / page).read_text()
    if heading is not None:
        text = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", text, re.M))


def test_generated_pages_match_the_code():
    stale = [str(p.relative_to(ROOT)) for p in gen_docs.stale()]
    assert not stale, f"run python scripts/gen_docs.py: stale {stale}"


def test_the_reference_lists_every_config_field_and_strategy_option():
    from parambox.box.base import BoxConfig
    from parambox.config import RunConfig
    from parambox.runtime.cluster import ClusterConfig
    from parambox.strategies import strategy_class

    documented = _table_keys("config.md")
    for model in (RunConfig, BoxConfig, ClusterConfig):
        missing = set(model.model_fields) - documented
        assert not missing, f"{model.__name__} fields missing from reference/config.md: {missing}"
    for name in gen_docs.strategy_names():  # the built-in ones (a test may have registered its own)
        options = set(strategy_class(name).Options.model_fields)
        assert options <= _table_keys("strategy-options.md", f"`{name}`"), name
        assert (DOCS / "guide" / "strategies" / f"{name}.md").exists(), f"no guide page for {name}"
        assert options <= set(
            re.findall(r"^\| `([^`]+)` \|", (DOCS / "guide" / "strategies" / f"{name}.md").read_text(), re.M)
        ), f"the guide page of {name} lacks some of its options"


def test_the_reference_lists_every_cli_flag():
    page = (DOCS / "reference" / "cli.md").read_text()
    for command, flags in gen_docs.cli_flags().items():
        section = page.split(f"\n## {command}\n", 1)[1].split("\n## ", 1)[0]
        listed = {
            s for cell in re.findall(r"^\| `([^`]+)` \|", section, re.M) for s in re.split(r",? ", cell)
        }
        assert set(flags) <= listed, f"parambox {command}: {set(flags) - listed} not in reference/cli.md"


def test_every_environment_variable_the_code_reads_is_documented():
    in_code = gen_docs.env_vars_in_code()
    documented = _table_keys("environment.md")
    assert in_code == set(gen_docs.ENV_VARS) == documented, (
        f"undocumented: {in_code - documented}; documented but gone: {documented - in_code}"
    )


def _matches(key: str, documented: set[str]) -> bool:
    return any(re.fullmatch(d.replace("<metric>", r"\w+"), key) for d in documented)


def test_the_run_directory_page_names_every_key_a_run_writes(tmp_path):
    out = tmp_path / "run"
    run_cli("train", "--strategy", "single", "--workers", "1", "--steps", "4", "--eval-every", "2",
            "--out", str(out), "--no-progress")  # fmt: skip
    files = gen_docs.RUN_FILES
    for path in files:
        if "<" not in path:
            assert (out / path).exists(), path
    summary_keys = set(files["summary.json"][1])
    assert all(_matches(k, summary_keys) for k in json.loads((out / "summary.json").read_text())), (
        summary_keys
    )
    entries = files["metrics.jsonl"][1]
    kinds = {e.split(": ")[0] for e in entries if ": " in e}
    metric_keys = {k.strip() for e in entries for k in e.split(": ")[-1].split(",")}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["kind"] in kinds, record["kind"]
        undocumented = [k for k in record if not _matches(k, metric_keys)]
        assert not undocumented, (
            f"metrics.jsonl {record['kind']} keys not on the run-directory page: {undocumented}"
        )
    from parambox.config import RunConfig

    assert set(json.loads((out / "config.json").read_text())) == set(RunConfig.model_fields)


DATED = re.compile(
    r"\b[0-9]{1,2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b"
    r"|\b[0-2][0-9]:[0-5][0-9]\b|`[0-9a-f]{7,40}`"
)


def test_the_readme_and_the_guide_carry_no_run_history():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    pages = [
        ROOT / "README.md",
        DOCS / "index.md",
        *(DOCS / "guide").rglob("*.md"),
        *(DOCS / "design").glob("*.md"),
    ]
    dated = [
        f"{p.relative_to(ROOT)}: {line}"
        for p in pages
        for line in p.read_text().splitlines()
        if DATED.search(line)
    ]
    assert not dated, "\n".join(dated)


def test_every_results_table_says_what_produced_it():
    for path in sorted((DOCS / "results").glob("*.json")):
        data = json.loads(path.read_text())
        for table in data["tables"]:
            for key in ("command", "machine", "version"):
                assert table.get(key), f"{path.name}: a table without its {key}"
            assert all(len(row) == len(table["columns"]) for row in table["rows"]), path.name


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built as CI builds it: ``mkdocs build --strict`` (warnings are errors: a broken link, a
    missing page or reference, an API object mkdocstrings cannot find)."""
    assert not gen_docs.stale(), "run python scripts/gen_docs.py first"  # the build's hook would rewrite them
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_site_builds_with_warnings_as_errors(site):
    html = (site / "reference" / "api" / "index.html").read_text()
    for name in (
        "parambox.api.train.train",
        "parambox.optim.DistributedOptimizer",
        "parambox.run.result.RunResult",
        "parambox.errors.BoxLost",
    ):
        assert f'id="{name}"' in html, f"{name} not rendered by mkdocstrings"
    assert (site / "guide" / "strategies" / "easgd" / "index.html").exists()
    assert (site / "results" / "img" / "time-to-accuracy.png").stat().st_size > 0


def _wait_for_a_browser_being_installed() -> None:
    """CI installs chromium while the tests run (.ci/run): it touches PARAMBOX_CHROMIUM_READY when done."""
    ready = os.environ.get("PARAMBOX_CHROMIUM_READY")
    deadline = time.monotonic() + 900  # apt-get's own timeouts, 300 + 600 s
    while ready and not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(1020)
def test_the_site_opens_in_a_browser_with_navigation_and_search(site, tmp_path):
    shots = _load("screenshot_docs")
    _wait_for_a_browser_being_installed()
    chrome = shots.browser()
    if chrome is None:
        pytest.skip("no chromium here (apt-get install chromium)")
    with shots.serve(site) as base:
        browser = shots.DevTools(chrome)
        try:
            browser.open(base + "guide/strategies/easgd/")
            assert browser.evaluate("document.querySelector('h1').textContent.trim()").startswith("easgd")
            links = browser.evaluate("document.querySelectorAll('nav.md-nav--primary a.md-nav__link').length")
            assert links > 30  # the whole navigation rendered
            browser.evaluate(
                "[...document.querySelectorAll('a.md-nav__link')].find(a => a.textContent.trim() === 'diloco').click()"
            )
            browser.wait_for("location.pathname.endsWith('/guide/strategies/diloco/')")
            assert search_results(shots, browser, base) > 0
            browser.screenshot(tmp_path / "search.png")
        finally:
            browser.close()
    assert (tmp_path / "search.png").stat().st_size > 10_000


def search_results(shots, browser, base) -> int:
    count = shots.search(browser, base, "slow network")
    titles = browser.evaluate(
        "[...document.querySelectorAll('.md-search-result__item h1')].slice(0, 3).map(h => h.textContent)"
    )
    assert any("Choosing a strategy" in t for t in titles), titles  # the page that answers it
    return count


def test_the_readme_and_changelog_links_point_at_files():
    for page in ("README.md", "CHANGELOG.md"):
        text = (ROOT / page).read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (ROOT / target).exists(), f"{page} links {target}, which does not exist"
