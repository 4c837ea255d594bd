"""The commands, one module each (`add_arguments(parser)` + `main(args) -> int`): parsing, printing
and the glue between the library's steps. The top floor: nothing in verlaudit imports a command
(`verlaudit.cli` finds them by name); each imports the libraries below it (`tests/test_architecture.py`
holds the order)."""
