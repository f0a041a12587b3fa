from .cli import main

main(prog_name="gpu-memory-exporter")
