"""The commands: the command line and what its subcommands do (bench, report,
why, export, deploy)."""
