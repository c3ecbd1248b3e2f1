"""Example environments used by docs/writing_an_environment.md."""
