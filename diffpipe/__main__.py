from diffpipe.cli import main

main()
