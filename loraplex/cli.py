"""The `loraplex` command. Each area registers its own subcommands; imports stay lazy so --help is fast."""

from __future__ import annotations

import importlib

import click

# group or command name -> "module:attribute" of a click command defined by the area that owns it
_SUBCOMMANDS = {
    "generate": "loraplex.engine.commands:generate",
    "model": "loraplex.engine.commands:model",
    "engine": "loraplex.platform.commands:engine",
    "serve": "loraplex.platform.commands:serve",
    "migrate": "loraplex.platform.commands:migrate",
    "worker": "loraplex.platform.commands:worker",
    "admin": "loraplex.platform.commands:admin",
    "bench": "loraplex.engine.commands:bench",
    "adapter": "loraplex.adapters.commands:adapter",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _SUBCOMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
            return getattr(module, attr)
        except (ImportError, AttributeError) as exc:
            reason = str(exc)  # `exc` is unbound once the except block ends

            @click.command(name=name, help=f"(unavailable: {reason})")
            def unavailable() -> None:
                raise click.ClickException(f"`loraplex {name}` is not available: {reason}")

            return unavailable


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loraplex")
def main() -> None:
    """loraplex: serve many tenants' LoRA adapters from one shared base model."""


if __name__ == "__main__":
    main()
