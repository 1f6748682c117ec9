package browsertest

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
)

// Problem describes a page's complaint among chromedp's events: a
// console.error, console.warn or failed console.assert, an uncaught
// exception, an error in the browser's log; "" for any other event. A UI
// test collects them (Watch) and fails on any.
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

// Watch collects the page's problems (Problem) from now on; the returned
// function lists them so far.
func Watch(t testing.TB, ctx context.Context) func() []string {
	t.Helper()
	var mu sync.Mutex
	var problems []string
	if err := chromedp.Listen(ctx, func(ev any) {
		if p := Problem(ev); p != "" {
			mu.Lock()
			problems = append(problems, p)
			mu.Unlock()
		}
	}); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(problems)
	}
}

// Eval evaluates a JavaScript expression in the page and decodes its JSON
// value into v; an error fails the test.
func Eval(t testing.TB, ctx context.Context, expr string, v any) {
	t.Helper()
	raw, err := chromedp.Run(ctx, chromedp.Evaluate[[]byte](expr))
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("decode %s: %v", expr, err)
	}
}
