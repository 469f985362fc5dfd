"""The ``kvplug`` click group and its small commands: ``backends``, ``new-backend``, ``demo``,
``simulate``.

``bench``, ``cache``, ``inspect``, ``config check``, ``serve`` and ``warm`` live in their own
modules and are added to the group here.

Every user error (bad name, bad config, missing file, vLLM not installed) prints one ``Error:`` line
to stderr and exits non-zero; tracebacks are for bugs only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path

import click
from rich.table import Table

from ..plugins import discover_backends, validate_backend_class
from .bench import bench_cmd
from .cache import cache_group
from .common import VLLM_INSTALL_HINT, console, err_console, escape, fail
from .config import config_group
from .inspect import inspect_cmd
from .serve import serve_cmd
from .warm import warm_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvplug", prog_name="kvplug")
def main() -> None:
    """kvplug: pluggable KV-cache storage tiers for vLLM."""


main.add_command(bench_cmd)
main.add_command(cache_group)
main.add_command(config_group)
main.add_command(inspect_cmd)
main.add_command(serve_cmd)
main.add_command(warm_cmd)


# -- kvplug backends ----------------------------------------------------------------------------
def backend_report() -> list[dict[str, str | None]]:
    """Every backend declared through entry points, loaded and validated (never raises)."""
    try:
        found = discover_backends()
    except Exception as exc:  # noqa: BLE001 - a name declared twice: report it, do not crash
        fail(str(exc))
    rows: list[dict[str, str | None]] = []
    for name, info in sorted(found.items()):
        error = None
        try:
            validate_backend_class(info.load(), info.name, info.package)
        except Exception as exc:  # noqa: BLE001 - a broken third-party package is a row, not a crash
            error = str(exc)
        rows.append({"name": name, "package": info.package, "version": info.version,
                     "target": info.target, "status": "valid" if error is None else "invalid",
                     "error": error})
    return rows


@main.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--check", is_flag=True, help="Exit 1 if any backend fails validation.")
def backends_cmd(as_json: bool, check: bool) -> None:
    """List every backend installed packages declare, and whether it passes validation."""
    rows = backend_report()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        console.print("No kvplug backends are installed (entry-point group kvplug.backends).")
    else:
        table = Table(title="kvplug backends (entry-point group kvplug.backends)")
        for col in ("Name", "Package", "Version", "Class", "Status"):
            table.add_column(col, no_wrap=col != "Class", overflow="fold")
        for r in rows:
            status = "[green]valid[/]" if r["error"] is None else "[red]invalid[/] (see below)"
            table.add_row(*(escape(r[k]) for k in ("name", "package", "version", "target")), status)
        console.print(table)
        for r in rows:
            if r["error"]:
                console.print(f"[red]{r['name']}[/]: {escape(r['error'])}", highlight=False, soft_wrap=True)
    if check and any(r["error"] for r in rows):
        raise click.exceptions.Exit(1)


# -- kvplug new-backend -------------------------------------------------------------------------
def template_dir() -> Path:
    """The cookiecutter template shipped in the ``kvplug.templates`` package."""
    path = Path(str(files("kvplug.templates") / "backend"))
    if not (path / "cookiecutter.json").is_file():
        fail(f"the backend template is missing from this kvplug install (looked in {path})")
    return path


@main.command("new-backend")
@click.argument("name")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("."), show_default=True, help="Where the package folder is created.")
@click.option("--package", "project_slug", help="Distribution name [default: kvplug-NAME].")
@click.option("--author", help="Author written into pyproject.toml.")
@click.option("--owns-allocator/--no-owns-allocator", default=None,
              help="Generate an allocate hook over a HostMemoryPool [default: no].")
@click.option("--key-value/--memory", "key_value", default=None,
              help="A tier over a key-value store, on kvplug's value-store base, or a bounded "
                   "in-memory store to replace hook by hook [default: memory].")
@click.option("--prompt", is_flag=True, help="Ask for every value not given as an option.")
@click.option("--force", is_flag=True, help="Overwrite an existing package folder.")
def new_backend_cmd(name: str, output_dir: Path, project_slug: str | None, author: str | None,
                    owns_allocator: bool | None, key_value: bool | None, prompt: bool,
                    force: bool) -> None:
    """Generate a backend package NAME (a Python identifier) from kvplug's template."""
    from cookiecutter.exceptions import CookiecutterException, FailedHookException
    from cookiecutter.main import cookiecutter

    context: dict[str, str] = {"backend_name": name}
    if project_slug:
        context["project_slug"] = project_slug
    if author:
        context["author"] = author
    if owns_allocator is not None:
        context["owns_allocator"] = "yes" if owns_allocator else "no"
    if key_value is not None:
        context["store_kind"] = "key_value" if key_value else "memory"
    output_dir.mkdir(parents=True, exist_ok=True)
    quiet = logging.getLogger("cookiecutter")  # it logs a traceback for a rejected name
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    try:
        with _own_temp_dir():
            path = Path(cookiecutter(str(template_dir()), no_input=not prompt,
                                     extra_context=context, output_dir=str(output_dir),
                                     overwrite_if_exists=force, default_config=True))
    except FailedHookException:
        fail(f"the template rejected the name {name!r} (the reason is printed above)")
    except CookiecutterException as exc:
        hint = "; pass --force to overwrite it" if "already exists" in str(exc) else ""
        fail(f"could not generate the package: {exc}{hint}")
    console.print(f"[green]Created[/] {escape(str(path))} — backend [bold]{escape(name)}[/]",
                  highlight=False)
    click.echo(
        "Next steps (its README.md shows the tier config and the vLLM flags):\n"
        f"  cd {path}\n  pip install -e '.[test]'\n  python -m pytest\n  kvplug backends"
    )


@contextmanager
def _own_temp_dir() -> Iterator[None]:
    """Temporary files made meanwhile go to a directory removed afterwards: cookiecutter writes
    each rendered hook script to a temporary file it never deletes."""
    with tempfile.TemporaryDirectory(prefix="kvplug-new-backend-") as scratch:
        saved, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            yield
        finally:
            tempfile.tempdir = saved


# -- kvplug demo ---------------------------------------------------------------------------------
@main.command("demo", context_settings={"ignore_unknown_options": True,
                                        "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo_cmd(args: tuple[str, ...]) -> None:
    """Run kvplug's vLLM demo (python -m kvplug.connector.demo ARGS...)."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        fail(f"vLLM is not installed ({exc}); {VLLM_INSTALL_HINT}")
    except Exception as exc:  # noqa: BLE001 - installed but broken (wrong torch, missing libs)
        fail(f"vLLM is installed but failed to import: {type(exc).__name__}: {exc}")
    if importlib.util.find_spec("kvplug.connector.demo") is None:
        fail("this kvplug install has no kvplug.connector.demo module")
    err_console.print("running: python -m kvplug.connector.demo " + " ".join(args), markup=False)
    raise click.exceptions.Exit(
        subprocess.call([sys.executable, "-m", "kvplug.connector.demo", *args])
    )



# -- kvplug simulate ----------------------------------------------------------------------------
@main.command("simulate", context_settings={"ignore_unknown_options": True,
                                            "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def simulate_cmd(args: tuple[str, ...]) -> None:
    """Run the deterministic simulation against a backend (python -m kvplug.connector.sim ARGS).

    --backend NAME|module:Class  --options JSON  --seeds N  --start S  --seed N (replay one)."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        fail(f"vLLM is not installed ({exc}); the simulation runs vLLM's scheduler: "
             f"{VLLM_INSTALL_HINT}")
    except Exception as exc:  # noqa: BLE001 - installed but broken (wrong torch, missing libs)
        fail(f"vLLM is installed but failed to import: {type(exc).__name__}: {exc}")
    raise click.exceptions.Exit(
        subprocess.call([sys.executable, "-m", "kvplug.connector.sim", *args])
    )
