// Command consul is the Consul agent and CLI, built from Consul's Go module
// at the pinned MPL-2.0 release, for consulrun's tests and benchmarks only.
package main

import (
	"fmt"
	"io"
	"log"
	"os"

	mcli "github.com/mitchellh/cli"

	"github.com/hashicorp/consul/command"
	consulcli "github.com/hashicorp/consul/command/cli"
	"github.com/hashicorp/consul/command/version"
)

func main() {
	log.SetOutput(io.Discard)
	ui := &consulcli.BasicUI{BasicUi: mcli.BasicUi{Writer: os.Stdout, ErrorWriter: os.Stderr}}
	commands := command.RegisteredCommands(ui)
	runner := &mcli.CLI{
		Args:        os.Args[1:],
		Commands:    commands,
		Name:        "consul",
		HelpFunc:    mcli.BasicHelpFunc("consul"),
		HelpWriter:  os.Stdout,
		ErrorWriter: os.Stderr,
	}
	if runner.IsVersion() {
		os.Exit(version.New(ui).Run(nil))
	}
	code, err := runner.Run()
	if err != nil {
		fmt.Fprintf(os.Stderr, "consul: %v\n", err)
		os.Exit(1)
	}
	os.Exit(code)
}
