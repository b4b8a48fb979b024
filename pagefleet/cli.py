"""The ``pagefleet`` command.

Each subcommand is a module exposing a ``click.Command`` named ``command``: the runtime
components' in ``pagefleet/<component>/cli.py``, the developer tools' in ``pagefleet/dev/``.
Each is imported only when invoked, so ``pagefleet gateway`` or ``pagefleet operator``
never load torch.
"""

from __future__ import annotations

import importlib

import click

# name -> (module holding `command`, one-line help shown by `pagefleet --help`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "daemon": ("pagefleet.daemon.cli", "Run one inference daemon (engine + OpenAI API)."),
    "gateway": ("pagefleet.gateway.cli", "Run the cache-aware OpenAI-compatible gateway."),
    "operator": ("pagefleet.operator.cli", "Run the Kubernetes operator (kopf)."),
    "up": ("pagefleet.dev.local_fleet", "Start a local fleet: Redis, N daemons, a gateway."),
    "bench": ("pagefleet.dev.loadgen", "Drive a workload through a gateway; print a report."),
    "crd": ("pagefleet.api.crd", "Print the InferenceService CRD YAML generated from the spec."),
    "dashboards": ("pagefleet.dev.dashboards", "Generate the Grafana dashboards into the chart."),
    "generate": ("pagefleet.dev.generate", "Run the engine alone on a few prompts; report."),
    "teardown": (
        "pagefleet.operator.teardown",
        "Delete every InferenceService and wait for the operator (Helm pre-delete hook).",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module_name, short = SUBCOMMANDS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("pagefleet"):
                raise click.ClickException(
                    f"`pagefleet {name}` is not available in this build ({exc.name} missing)"
                ) from exc
            raise click.ClickException(
                f"`pagefleet {name}` needs the Python package {exc.name!r}; "
                "install pagefleet with the matching extra, e.g. pip install 'pagefleet[dev]'"
            ) from exc
        cmd: click.Command = module.command
        if not cmd.short_help:
            cmd.short_help = short
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing help must not import every component (and torch): use the static table.
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pagefleet")
def cli() -> None:
    """pagefleet: LLM serving on Kubernetes with paged KV and cache-aware routing.

    Start a local fleet with `pagefleet up`, drive it with `pagefleet bench`; on a cluster,
    `pagefleet crd | kubectl apply -f -` and run `pagefleet operator`.
    """


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
