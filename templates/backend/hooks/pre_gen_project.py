"""Reject names that would generate a broken package, before any file is written."""

import keyword
import re
import sys

BACKEND_NAME = {{ cookiecutter.backend_name | tojson }}
PROJECT_SLUG = {{ cookiecutter.project_slug | tojson }}
MODULE_NAME = {{ cookiecutter.__module_name | tojson }}
OWNS_ALLOCATOR = {{ cookiecutter.owns_allocator | tojson }}
STORE_KIND = {{ cookiecutter.store_kind | tojson }}

# Names kvplug itself declares: a second package declaring one is a startup error.
RESERVED = {"local_cpu", "posix", "gds", "fsspec", "resp", "mooncake"}
# PEP 508 distribution names.
DIST_RE = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")


def problems() -> list:
    out = []
    if not BACKEND_NAME.isidentifier() or keyword.iskeyword(BACKEND_NAME):
        out.append(
            f"backend name {BACKEND_NAME!r} is not a valid Python identifier: use letters, "
            "digits and underscores, not starting with a digit (e.g. 'mystore' or 'my_store')"
        )
    elif BACKEND_NAME in RESERVED:
        out.append(
            f"backend name {BACKEND_NAME!r} is already declared by kvplug itself "
            f"({', '.join(sorted(RESERVED))}); choose another name"
        )
    if not DIST_RE.match(PROJECT_SLUG):
        out.append(
            f"package name {PROJECT_SLUG!r} is not a valid distribution name: use letters, "
            "digits, '-', '_' and '.', starting and ending with a letter or digit"
        )
    elif not MODULE_NAME.isidentifier() or keyword.iskeyword(MODULE_NAME):
        out.append(
            f"package name {PROJECT_SLUG!r} gives the import name {MODULE_NAME!r}, which is not a "
            "valid Python identifier; start it with a letter"
        )
    if OWNS_ALLOCATOR not in ("yes", "no"):
        out.append(f"owns_allocator must be 'yes' or 'no', not {OWNS_ALLOCATOR!r}")
    if STORE_KIND not in ("memory", "key_value"):
        out.append(f"store_kind must be 'memory' or 'key_value', not {STORE_KIND!r}")
    elif STORE_KIND == "key_value" and OWNS_ALLOCATOR == "yes":
        out.append(
            "a key_value tier reads into the fastest tier's memory pool and owns none: use "
            "owns_allocator=no and keep local_cpu in front of it"
        )
    return out


if __name__ == "__main__":
    found = problems()
    for line in found:
        print(f"ERROR: {line}", file=sys.stderr)
    if found:
        sys.exit(1)
