def add_arguments(p):
    p.add_argument("--out", default="outputs/bench/gpu")
def main(args):
    return 0
