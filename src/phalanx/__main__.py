from phalanx.cli.main import run_command

run_command()
