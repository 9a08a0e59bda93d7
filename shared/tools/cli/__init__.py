"""The `tsukimi` command line: generate, chat, bench."""
