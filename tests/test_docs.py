"""The README and docs/: every command named in the README, the option reference generated from the code, every
link between the pages leading somewhere, and the README short enough to read in five minutes."""

import re

import typer.main
from conftest import ROOT

from docs import generate_commands
from job.cli import app

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_names_every_command_and_stays_short():
    text = README.read_text()
    assert len(text.encode()) < 15_000
    summary = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    for name in typer.main.get_command(app).commands:
        assert f"python -m job {name} " in summary, name


def test_the_option_reference_is_the_commands_own_help():
    page = generate_commands.PAGE.read_text()
    assert page == generate_commands.page(page), "docs/commands.md is out of date: python -m docs.generate_commands"
    assert "--check-images" in page and "--nproc-per-node" in page  # the options themselves, not only the names


def anchors(path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces made hyphens."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_link_between_the_pages_leads_somewhere():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # the generated help is not markdown
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken
