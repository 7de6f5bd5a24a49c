; The install page's progress bar, moved by bytes written: the generated file lists call
; Progress (0 to 30000, NSIS's range) after each thousandth of the payload. The setup
; finds the bar; a part gets its window handle from the setup (/PROGRESSBAR=), so the bar
; keeps moving while a part installs. 0 when silent: there is no bar.

!include LogicLib.nsh
!include WinMessages.nsh

Var ProgressBar

!macro Progress POSITION
  ${If} $ProgressBar <> 0
    ; A timeout, because a part sends to the setup's window in another process.
    SendMessage $ProgressBar ${PBM_SETPOS} ${POSITION} 0 /TIMEOUT=1000
  ${EndIf}
!macroend
