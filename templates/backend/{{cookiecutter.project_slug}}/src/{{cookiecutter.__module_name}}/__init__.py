"""The ``{{ cookiecutter.backend_name }}`` kvplug storage tier."""

from .backend import {{ cookiecutter.__class_name }}

__all__ = ["{{ cookiecutter.__class_name }}"]
