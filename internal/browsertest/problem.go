package browsertest

import (
	"fmt"
	"strings"

	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
)

// Problem describes a page's complaint among chromedp's events: a
// console.error, console.warn or failed console.assert, an uncaught
// exception, an error in the browser's log; "" for any other event. A UI
// test listens (chromedp.ListenTarget) and fails on what it collects.
func Problem(ev any) string {
	switch ev := ev.(type) {
	case *runtime.EventConsoleAPICalled:
		if ev.Type == runtime.ConsoleAPICalledTypeError || ev.Type == runtime.ConsoleAPICalledTypeWarning || ev.Type == runtime.ConsoleAPICalledTypeAssert {
			var args []string
			for _, a := range ev.Args {
				args = append(args, string(a.Value)+a.Description)
			}
			return "console." + string(ev.Type) + ": " + strings.Join(args, " ")
		}
	case *runtime.EventExceptionThrown:
		d := ev.ExceptionDetails
		desc := d.Text
		if d.Exception != nil {
			desc += " " + d.Exception.Description
		}
		return fmt.Sprintf("exception at line %d: %s", d.LineNumber+1, desc)
	case *log.EventEntryAdded:
		if ev.Entry.Level == log.EntryLevelError {
			return "browser log: " + ev.Entry.Text + " " + ev.Entry.URL
		}
	}
	return ""
}
