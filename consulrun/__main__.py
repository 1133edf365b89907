from consulrun.cli import main

main()
