"""What the frozen bundle runs: the agent's console entry point, nothing else."""

from orchard.inagent.main import main

if __name__ == "__main__":
    main()
