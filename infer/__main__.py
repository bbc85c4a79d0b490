from infer.cli import main

main()
