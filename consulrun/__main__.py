from consulrun.entry import main

main()
