def main(argv=None):
    raise SystemExit("hotcold: not yet implemented")
