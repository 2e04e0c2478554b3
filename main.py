"""Entry point, as in the seed repo: python main.py train=acco (see acco/cli.py)."""

from acco.cli import entry

if __name__ == "__main__":
    entry()
