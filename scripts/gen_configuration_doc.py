"""Write docs/configuration.md: every flag and environment variable of every service and of
``tokenmill up``, read from the settings dataclasses through the same argparse parser that
``--help`` prints, so the page says what the code accepts.

    .venv/bin/python scripts/gen_configuration_doc.py           # rewrite the page
    .venv/bin/python scripts/gen_configuration_doc.py --check   # exit 1 when the page is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.cli.serve import SERVICES  # noqa: E402
from services.common.settings import add_config_arguments  # noqa: E402

OUTPUT = ROOT / "docs" / "configuration.md"
COMMAND = ".venv/bin/python scripts/gen_configuration_doc.py"


def service_config(service: str) -> type:
    """The config dataclass a service's entry point parses: the one in its main module built on
    the service's process fields."""
    module = importlib.import_module(SERVICES[service])
    found = {value for value in vars(module).values()
             if isinstance(value, type) and dataclasses.is_dataclass(value)
             and any(base.__name__ == f"{service.capitalize()}ProcessFields" for base in value.__mro__)}
    if len(found) != 1:
        raise RuntimeError(f"{SERVICES[service]}: expected one config built on the process fields, got {found}")
    return found.pop()


def configs() -> dict[str, tuple[str, type]]:
    """Command line -> (title, config dataclass), in the order the page lists them."""
    from services.cli.up import UpConfig

    out = {"tokenmill up": ("the launcher (`make run` runs it)", UpConfig)}
    for service in SERVICES:
        out[f"tokenmill serve {service}"] = (f"the {service} service", service_config(service))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _portable(text: str) -> str:
    """Relative path defaults are made absolute where they are parsed: show them relative."""
    return text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")


def section(command: str, title: str, config_cls: type) -> list[str]:
    # An empty environment: the page shows the dataclass defaults, not this shell's settings.
    parser = argparse.ArgumentParser(prog=command, add_help=False)
    add_config_arguments(parser, config_cls, env={})
    lines = [f"## `{command}`: {title}", "",
             f"Settings class `{config_cls.__module__}.{config_cls.__qualname__}`.", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings]
        if not actions:
            continue
        lines += [f"### {group.title}", "", "| flag | help (default; environment variable) |", "|---|---|"]
        for action in actions:
            flags = " / ".join(f"`{flag}`" for flag in action.option_strings)
            if action.metavar and not isinstance(action, argparse.BooleanOptionalAction):
                flags += f" `{action.metavar}`"
            help_text = _portable((action.help or "").replace("%%", "%"))
            if action.required:
                help_text += " (required)"
            lines.append(f"| {flags} | {_cell(help_text)} |")
        lines.append("")
    return lines


def render() -> str:
    lines = ["# Configuration", "",
             f"Generated from the settings dataclasses by `{COMMAND}`; do not edit by hand "
             "(tests/test_configuration_doc.py fails when this page is stale).", "",
             "Every setting is a command-line flag and, where listed, an environment variable. "
             "Precedence: flag > environment variable > default. `tokenmill serve SERVICE --help` "
             "prints the same text, with the defaults in effect in that shell. A boolean `--x` has "
             "`--no-x` to turn it off; a list takes comma-separated items.", ""]
    table = configs()
    lines += ["| command | settings |", "|---|---|"]
    for command, (title, _) in table.items():
        anchor = command.replace(" ", "-")
        lines.append(f"| [`{command}`](#{anchor}-{title.replace(' ', '-').replace('(', '').replace(')', '').replace('`', '')}) | {title} |")
    lines.append("")
    for command, (title, config_cls) in table.items():
        lines += section(command, title, config_cls)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
