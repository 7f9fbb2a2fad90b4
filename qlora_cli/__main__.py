from qlora_cli.cli import main

main()
